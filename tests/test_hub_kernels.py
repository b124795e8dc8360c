"""transformers (5.25 on) kernelizes what ``from_pretrained`` loads, and again at every ``train()``/``eval()``; the
copy LazyTrain traces is on ``meta``, which kernelizing refuses.  The copy is stripped of the hub's kernels, and the
models LazyTrain loads are loaded without them."""

import torch
from torch import nn

from lazytrain.frontend import hub_kernels


class _Norm(nn.Module):
    def forward(self, x):
        return x * 2


class _Kernel(nn.Module):
    def forward(self, x):
        return x * 3


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Norm()

    def forward(self, x):
        return self.norm(x)


def test_a_kernelized_copy_runs_its_own_forward_and_is_not_kernelized_again():
    m = _Model()
    # what kernelizing leaves: a hub kernel's forward bound on the instance, and the model marked as kernelized
    m.norm.forward = _Kernel.forward.__get__(m.norm)
    m.norm.__dict__["_kernel_repo"] = "kernels-community/some-norm"
    m._use_kernels, m._kernels_mode = True, "training"
    assert m(torch.ones(1)).item() == 3
    hub_kernels.strip(m)
    assert m(torch.ones(1)).item() == 2
    assert "_kernel_repo" not in m.norm.__dict__ and m._use_kernels is False and m._kernels_mode is None


def test_loading_asks_for_no_kernels_only_where_transformers_has_them():
    class Old:
        class PreTrainedModel:
            pass

    class New:
        class PreTrainedModel:
            def set_use_kernels(self, use_kernels):
                pass
    assert hub_kernels.load_kwargs(Old) == {} and hub_kernels.load_kwargs(New) == {"use_kernels": False}
