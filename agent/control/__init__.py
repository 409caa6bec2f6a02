"""Control: the socket server, the commands applied at a step boundary, and ``lossguard-ctl``."""
