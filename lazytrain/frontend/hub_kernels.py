"""transformers' hub kernels kept out of the models LazyTrain traces and trains.

Since 5.25 transformers kernelizes every model ``from_pretrained`` loads (``use_kernels`` on by default, with the
``kernels`` package it now requires): modules decorated for it may run a kernel downloaded from the Hugging Face
Hub instead of their own forward, and every change between training and evaluation mode kernelizes the model again.
LazyTrain runs the model's own torch code (``torch.export`` of its blocks), and its trace works on a copy on the
``meta`` device, which kernelizing refuses ("Unsupported device type 'meta'"): the models it loads are loaded without
kernels, and the copy it traces is stripped of them.
"""

from __future__ import annotations


def load_kwargs(tf) -> dict:
    """``from_pretrained``'s keyword that turns the hub's kernels off, for a transformers (``tf``) that has them."""
    return {"use_kernels": False} if hasattr(tf.PreTrainedModel, "set_use_kernels") else {}


def strip(model) -> None:
    """Undo what kernelizing did to ``model`` (a copy of the caller's, on any device), as transformers'
    ``reset_kernels`` does but without kernelizing again (which a ``meta`` model cannot): each module back on its
    class's own forward, and the model marked as not kernelized, so that ``train()`` does not kernelize it."""
    for module in model.modules():
        if "_kernel_repo" in module.__dict__:        # a hub kernel's forward bound on the instance
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_kernel_repo", None)
    if getattr(model, "_use_kernels", False):
        model._use_kernels = False
        model._kernels_mode = None
