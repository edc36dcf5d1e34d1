"""The trainer side: code that runs in the training process, next to torch.

It talks to the daemon only through the messages of ``aiockpt._core.protocol``, and never
imports the daemon side (``aiockpt._daemon``).
"""
