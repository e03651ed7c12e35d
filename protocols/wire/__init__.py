"""The wire vocabulary that the server and the clients share, Flower-free.

:mod:`.intermediate` is DDP-SA's gRPC protocol to the intermediate servers (``intermediate.proto``, its generated
stubs, the signed statements and the client of the service).
"""
