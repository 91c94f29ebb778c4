"""trireme.ops.pdl: when kernels launch with programmatic dependent launch. (That the kernels
compile with griddepcontrol for sm_90 is tests/test_argmax_triton.py's and
tests/test_kernels_compile.py's; that it changes no token is bench/pdl_check.py's, on a GPU.)"""

import torch

from trireme.ops import pdl
from trireme.ops.kernel_settings import KernelSettings


class FakeCuda:  # a tensor's device facts, as launch_pdl reads them
    is_cuda = True
    device = torch.device("cuda", 0)


def test_only_cuda_tensors_of_sm90_launch_with_pdl(monkeypatch):
    assert not pdl.launch_pdl(torch.zeros(2))  # the CPU (and the interpreter): never
    for major, want in ((8, False), (9, True), (10, True)):  # Ampere, Hopper, Blackwell
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, m=major: (m, 0))
        pdl._capable.cache_clear()
        assert pdl.launch_pdl(FakeCuda()) is want
        assert pdl.launch_pdl(FakeCuda(), KernelSettings(pdl=True)) is want
    pdl._capable.cache_clear()
    assert not pdl.launch_pdl(FakeCuda(), KernelSettings(pdl=False))  # turned off (--pdl off)


def test_early_reads_are_on_with_pdl_unless_turned_off(monkeypatch):
    """Measured faster with the same tokens: on by default where PDL is."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    pdl._capable.cache_clear()
    try:
        assert pdl.early_reads(FakeCuda())
        assert not pdl.early_reads(FakeCuda(), KernelSettings(early_reads=False))
        assert not pdl.early_reads(FakeCuda(), KernelSettings(pdl=False))  # no PDL: no early
        assert not pdl.early_reads(torch.zeros(1))
    finally:
        pdl._capable.cache_clear()
