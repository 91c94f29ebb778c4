"""Run a script through Triton's CPU interpreter, in a subprocess (TRITON_INTERPRET must be set
before triton is imported): how the tests check the Triton kernels on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


# Prepended to every script: Triton 3.6's interpreter turns a runtime scalar (a loop bound such
# as `range(0, n_cols, BLOCK)`) into an int with int() of a one-element 1-d numpy array, which
# NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"); Triton
# 3.9 squeezes it first, and so does this, on any version that patches tensors this way.
INDEX_FIX = """
from triton.runtime import interpreter as _interp
_plain_patch_tensor = getattr(_interp, "_patch_lang_tensor", None)
if _plain_patch_tensor is not None:
    def _patch_tensor(tensor, scope):
        _plain_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    _interp._patch_lang_tensor = _patch_tensor
"""


def run_in_interpreter(script: str) -> str:
    """`python -c script` with TRITON_INTERPRET=1 and the repository importable (INDEX_FIX
    first); its stdout, stripped. Fails (with its output) if the script does; skipped without
    Triton (a CPU torch does not bring it: `pip install triton` to run these)."""
    pytest.importorskip("triton", reason="the kernels run in Triton's interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    script = INDEX_FIX + script
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


# Prepend to a script whose kernels take tl.dot of bf16 operands: Triton 3.9's interpreter
# multiplies bf16 operands as their raw uint16 bits; this widens them to fp32 first (exact), as
# the GPU's bf16 tensor cores do before accumulating in fp32.
BF16_DOT = """
import numpy as _np
from triton.runtime import interpreter as _interp
import triton.language as _tl
_plain_dot = _interp.InterpreterBuilder.create_dot
def _widened(x):
    if x.dtype.scalar != _tl.bfloat16:
        return x
    bits = x.data.astype(_np.uint32) << 16
    return _interp.TensorHandle(bits.view(_np.float32), _tl.float32)
def _create_dot(self, a, b, *rest):
    return _plain_dot(self, _widened(a), _widened(b), *rest)
_interp.InterpreterBuilder.create_dot = _create_dot
"""


# Prepend to a script whose kernels cast fp32 to bf16 and whose test compares the rounding:
# Triton 3.9's interpreter truncates fp32 -> bf16 (drops the low 16 bits); the GPU rounds to the
# nearest even (LLVM's fptrunc), as torch does, which this makes the interpreter do.
BF16_ROUND = """
import numpy as _np
import torch as _torch
from triton.runtime import interpreter as _interp
import triton.language as _tl
_plain_cast = _interp.InterpreterBuilder.cast_impl
def _cast_impl(self, src, dst_type):
    if src.dtype.scalar != _tl.float32 or dst_type.scalar != _tl.bfloat16:
        return _plain_cast(self, src, dst_type)
    rounded = _torch.from_numpy(_np.array(src.data, dtype=_np.float32)).to(_torch.bfloat16)
    return _interp.TensorHandle(rounded.view(_torch.int16).numpy().view(_np.uint16), _tl.bfloat16)
_interp.InterpreterBuilder.cast_impl = _cast_impl
"""



# Prepend to a script whose kernels cast fp32 to float8_e5m2: Triton's interpreter (3.6, 3.9)
# drops the carry of a rounded-up mantissa into the exponent (7917.2 -> 4096, not 8192) and
# truncates subnormals (about 8% of random values come out wrong); the GPU (sm_90:
# cvt.rn.satfinite) rounds to the nearest even, as torch's .to(torch.float8_e5m2) does, which this
# makes the interpreter do.
E5M2_ROUND = """
import numpy as _np
import torch as _torch
from triton.runtime import interpreter as _interp
import triton.language as _tl
_plain_fp_to_fp = _interp.InterpreterBuilder.create_fp_to_fp
def _fp_to_fp(self, src, dst_type, rounding_mode):
    if src.dtype.scalar != _tl.float32 or dst_type.scalar != _tl.float8e5:
        return _plain_fp_to_fp(self, src, dst_type, rounding_mode)
    rounded = _torch.from_numpy(_np.array(src.data, dtype=_np.float32)).to(_torch.float8_e5m2)
    return _interp.TensorHandle(rounded.view(_torch.uint8).numpy(), _tl.float8e5)
_interp.InterpreterBuilder.create_fp_to_fp = _fp_to_fp
"""

def run_sm90_script(script: str, tmp_path: Path) -> str:
    """`python -c script` in tmp_path (a Triton cache of its own, fp fusion on as on a GPU): a
    script that compiles kernels for sm_90 without a GPU and prints "ok" last; skipped without
    Triton's NVIDIA tools. Its stdout."""
    triton = pytest.importorskip("triton", reason="the kernels need Triton")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("Triton without its NVIDIA backend tools")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "ok", proc.stdout + proc.stderr
    return proc.stdout


def compile_for_sm90(fn, constexprs: dict, types: dict, num_warps: int = 4,
                     num_stages: int = 3):
    """Compile a @triton.jit kernel for sm_90 (the H100 / H200) with Triton's real compiler, no
    GPU needed: what the interpreter cannot show (a kernel that runs there may still fail to
    compile, e.g. statements after a return in a constexpr `if`). `types` maps runtime
    arguments to their Triton type ("*bf16", "fp32", "i64"); the others are i32. Skips without
    Triton's NVIDIA backend."""
    pytest.importorskip("triton", reason="compiling a kernel needs Triton")
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # a Triton without the NVIDIA backend
        pytest.skip(f"Triton cannot compile for sm_90 here: {e}")
    signature = {n: types.get(n) or ("constexpr" if n in constexprs else "i32")
                 for n in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                torch.float8_e5m2: "*fp8e5", torch.float8_e4m3fn: "*fp8e4nv",
                torch.int64: "*i64", torch.int32: "*i32", torch.int8: "*i8", torch.uint8: "*u8",
                torch.bool: "*i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def recorded_launches(module, call) -> list[tuple[object, dict, dict]]:
    """The launches `call()` makes of `module`'s @triton.jit kernels, recorded instead of run
    (CPU tensors will do): (kernel, {argument: value}, launch options) each."""
    triton = pytest.importorskip("triton", reason="recording a launch needs Triton")

    seen = []

    class Recorder:
        def __init__(self, jit):
            self.jit = jit

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
                values = dict(zip(self.jit.arg_names, args)) | kwargs
                seen.append((self.jit, values, options))
            return launch

    kernels = {name: v for name, v in vars(module).items()
               if isinstance(v, triton.runtime.JITFunction)}
    try:
        for name, jit in kernels.items():
            setattr(module, name, Recorder(jit))
        call()
    finally:
        for name, jit in kernels.items():
            setattr(module, name, jit)
    return seen


def compile_recorded_for_sm90(module, call) -> list:
    """Each launch of recorded_launches(module, call) compiled for sm_90 by compile_for_sm90
    (argument types from the recorded values: tensors as pointers of their dtype, ints as i32
    or i64, floats as fp32, constexprs as given or their defaults)."""
    compiled = []
    for jit, values, options in recorded_launches(module, call):
        consts, types = {}, {}
        for param in jit.params:
            name, value = param.name, values.get(param.name)
            if param.is_constexpr:
                consts[name] = values.get(name, param.default)
            elif isinstance(value, torch.Tensor):
                types[name] = TRITON_TYPES[value.dtype]
            elif isinstance(value, float):
                types[name] = "fp32"
            elif isinstance(value, bool):
                types[name] = "i1"
            elif isinstance(value, int) and not -2**31 <= value < 2**31:
                types[name] = "i64"
        compiled.append(compile_for_sm90(jit, consts, types, options.get("num_warps", 4),
                                         options.get("num_stages", 3)))
    return compiled
