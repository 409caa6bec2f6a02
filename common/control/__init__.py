"""Control protocol v1 (docs/control.md): the messages, the client and the server that the agent
and the supervisor both serve. Torch-free."""
