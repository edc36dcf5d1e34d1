"""Shared, pure code: used by the trainer side, the daemon side and the CLI.

Nothing here imports torch, the trainer side (``aiockpt._trainer``) or the daemon side
(``aiockpt._daemon``): the protocol between the two processes, the on-disk format, shared memory.
"""
