"""trireme.ops.pdl: when kernels launch with programmatic dependent launch. (That the kernels
compile with griddepcontrol for sm_90 is tests/test_argmax_triton.py's and
tests/test_kernels_compile.py's; that it changes no token is bench/pdl_check.py's, on a GPU.)"""

import torch

from trireme.ops import pdl


def test_only_cuda_tensors_of_sm90_launch_with_pdl(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert not pdl.launch_pdl(torch.zeros(2))  # the CPU (and the interpreter): never

    class FakeCuda:  # a tensor's device facts, as launch_pdl reads them
        is_cuda = True
        device = torch.device("cuda", 0)

    for major, want in ((8, False), (9, True), (10, True)):  # Ampere, Hopper, Blackwell
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, m=major: (m, 0))
        pdl._capable.cache_clear()
        assert pdl.launch_pdl(FakeCuda()) is want
    pdl._capable.cache_clear()
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.launch_pdl(FakeCuda())  # turned off
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.launch_pdl(FakeCuda())


def test_early_reads_are_on_with_pdl_unless_turned_off(monkeypatch):
    """Measured faster with the same tokens (bench/RESULTS.md): on by default where PDL is."""
    t = torch.empty(1)
    monkeypatch.setattr(pdl, "launch_pdl", lambda t: True)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    assert pdl.early_reads(t)
    monkeypatch.setenv(pdl.PREFETCH_ENV, "0")
    assert not pdl.early_reads(t)
    monkeypatch.setattr(pdl, "launch_pdl", lambda t: False)
    monkeypatch.delenv(pdl.PREFETCH_ENV)
    assert not pdl.early_reads(t)
