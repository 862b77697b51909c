"""Bridges to the tools people already train with; each submodule needs its optional package.

:mod:`interlace.integrations.lightning` (``pip install interlace[lightning]``): a PyTorch
Lightning strategy. :mod:`interlace.integrations.huggingface` (``interlace[huggingface]``): the
Hugging Face Trainer and Accelerate. DDP communication hooks need no bridge: see
:meth:`interlace.DataParallel.register_comm_hook`.
"""
