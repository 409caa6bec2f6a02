"""Control: the socket server and the commands applied at a step boundary."""
