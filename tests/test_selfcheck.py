"""python -m solution.selfcheck (solution/selfcheck.py) on the CPU interpreter.

(a) As the user runs it on a machine without a GPU: a child process, with no TRITON_INTERPRET in its
    environment (the self-check sets it for itself; on a GPU machine the test sets it, to check the
    same interpreter path), prints one line per check (Russian and English), every check OK or SKIP
    (the GPU, saying why, and the CUDA-only attention), nothing on stderr, a summary that says the
    GPU checks were skipped, exit 0. Its patch names are the ones $SOLUTION_SKIP_PATCHES takes.
(b) A failing check (a kernel made to differ from its reference, or no accepted device) is a FAIL
    line, leads the summary, and makes the exit status 1; a bad command line exits 2 with one
    ``error:`` line before any check runs.
(c) The references of solution/_references.py against the stock code they stand for.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from solution import _references as R
from solution import selfcheck
from tests.conftest import pythonpath_without_repo

ROOT = Path(__file__).resolve().parent.parent
CYRILLIC = re.compile(r"[А-Яа-яЁё]")


def test_selfcheck_on_the_cpu_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = pythonpath_without_repo(str(ROOT))
    if torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "solution.selfcheck"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""  # a library's log lines (bitsandbytes' optional CPU kernel) stay inside the checks
    lines = proc.stdout.splitlines()
    checks = [l for l in lines if re.match(r"(OK|FAIL|SKIP) ", l)]
    subjects = [l[5:].split(":")[0] for l in checks]
    for prefix in ("Python ", "torch ", "Triton ", "transformers ", "peft ", "bitsandbytes ", "trl ", "CPU"):
        assert any(s.startswith(prefix) for s in subjects), prefix
    kernels = sorted(p.stem for p in (ROOT / "solution" / "kernels").glob("[!_]*.py"))
    assert sorted(k[0] for k in selfcheck.KERNELS) == kernels  # every kernel module is checked
    for name in kernels:
        assert any(s.startswith(f"kernel {name}") for s in subjects), name
    assert "patches" in subjects
    for line in checks:
        assert CYRILLIC.search(line) and " / " in line, line  # Russian, then English
        ok = line.startswith("OK ") or line.startswith("SKIP kernel attn_varlen") or line.startswith("SKIP GPU: ")
        assert ok, line
    gpu = next(l for l in checks if l.startswith("SKIP GPU: "))
    why = "TRITON_INTERPRET=1 is set" if torch.cuda.is_available() else "no CUDA GPU on this machine"
    assert why in gpu and "the GPU checks are skipped: " + selfcheck.GPU_CHECKS_EN in gpu, gpu
    assert checks.index(gpu) + 1 == subjects.index("CPU")  # why not the GPU, then what runs instead
    assert re.search(r"OK   kernel nf4_dequant \(cpu\).*: 0 wrong values", proc.stdout)
    assert re.search(r"OK   patches: .* (\d+) installed and reverted, all \d+ replaced objects back", proc.stdout)
    assert lines[-2].startswith("Проверки на GPU пропущены") and "The GPU checks were skipped" in lines[-2]
    assert lines[-1].startswith("ИТОГ / SUMMARY: все проверки пройдены / every check passed")
    from solution import _apply

    named = [n for l in checks if "accepted by the patches " in l
             for n in l.split("accepted by the patches ")[1].split(", ")]
    assert sorted(set(named)) == sorted(n for n in _apply.patch_names() if n != _apply.ALLOCATOR)


def test_every_patch_is_under_a_library():
    from solution.patches import PATCHES

    listed = {f"solution.patches.{m}" for _, _, modules in selfcheck.LIBRARIES for m in modules}
    assert listed == set(PATCHES)


def test_no_gpu_line_on_a_gpu_machine(monkeypatch):
    """With a GPU and no TRITON_INTERPRET the kernels run on the GPU: the self-check leaves the
    interpreter off and prints no SKIP line for the GPU (an accepted GPU's OK line instead)."""
    from solution import env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert selfcheck.interpret_without_gpu() is False and "TRITON_INTERPRET" not in os.environ
    monkeypatch.setattr(env, "check_support", lambda: env.Support(True, "cuda", "test"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    lines, device = selfcheck.check_device()
    assert device == "cuda" and [l.text() for l in lines] == ["OK   GPU Tesla T4 (sm_75): принята / accepted (sm_75 or newer)"]
    assert not any("GPU" in t for t in selfcheck.summary(lines)[:-1])


@pytest.fixture
def quick(monkeypatch):
    """Two cheap kernels only; the patches check as it is."""
    keep = {"rmsnorm", "fp32_add"}
    monkeypatch.setattr(selfcheck, "KERNELS", tuple(k for k in selfcheck.KERNELS if k[0] in keep))


def test_a_kernel_off_its_reference_fails_first_in_the_summary(quick, monkeypatch, capsys):
    monkeypatch.setattr(R, "residual_add", lambda r, y: r.double() + 1.01 * y.double())
    assert selfcheck.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    bad = [l for l in out if l.startswith("FAIL")]
    assert len(bad) == 2 and bad[0] == bad[1]  # the check's line, then again first in the summary
    assert re.match(r"FAIL kernel fp32_add \((cpu|cuda)\): не совпадает с эталоном / does not match its reference",
                    bad[0])  # cpu under the interpreter (CI), cuda on a GPU machine
    summary = out[out.index("-" * 80) + 1:]
    assert summary[0] == bad[0] and summary[-1].startswith("ИТОГ / SUMMARY: 1 из ")
    assert any(re.match(r"OK   kernel rmsnorm \((cpu|cuda)\)", l) for l in out)


def test_a_kernel_that_never_launches_fails(quick, monkeypatch, capsys):
    from solution.kernels import fp32_add

    monkeypatch.setattr(fp32_add, "supported", lambda a, b: False)  # torch's add instead of the kernel
    assert selfcheck.main([]) == 1
    assert re.search(r"FAIL kernel fp32_add \((cpu|cuda)\): ядро не запускалось / did not launch: fp32_add_kernel",
                     capsys.readouterr().out)


def test_no_accepted_device(quick, monkeypatch, capsys):
    from solution import env

    monkeypatch.setattr(env, "check_support", lambda: env.Support(False, "none", "no CUDA GPU (test)"))
    assert selfcheck.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL GPU: ядра здесь не запустятся / no CUDA GPU (test)" in out
    assert "SKIP kernel rmsnorm: " in out and "SKIP patches: " in out


def test_bad_command_line(capsys):
    assert selfcheck.main(["--gpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: python -m solution.selfcheck takes no arguments")


def test_an_exception_in_a_check_is_one_fail_line(quick, monkeypatch, capsys):
    def broken(dev):
        raise RuntimeError("broken on purpose\nsecond line")

    monkeypatch.setattr(selfcheck, "KERNELS", (("rmsnorm", broken, False, 1e-5, "test"),))
    assert selfcheck.main([]) == 1
    assert ("FAIL kernel rmsnorm: ошибка при проверке / RuntimeError: broken on purpose"
            in capsys.readouterr().out)


# --- the references against the stock code ----------------------------------------------------------
def test_references_match_the_stock_code():
    from transformers.models.qwen2 import modeling_qwen2

    torch.manual_seed(0)
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    norm = modeling_qwen2.Qwen2RMSNorm(8, eps=1e-6).double()
    norm.weight.data.copy_(w)
    assert torch.allclose(R.rmsnorm(x, w, 1e-6), norm(x))
    q, k = torch.randn(2, 3, 5, 8, dtype=torch.float64), torch.randn(2, 1, 5, 8, dtype=torch.float64)
    cos, sin = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    for a, b in zip(R.rope(q, k, cos, sin), modeling_qwen2.apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.allclose(a, b)
    g, u = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    assert torch.allclose(R.swiglu(g, u), torch.nn.functional.silu(g) * u)


def test_nf4_reference_is_bitsandbytes():
    bnbF = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(8, 64, dtype=torch.float16) * 0.05
    for nested in (True, False):
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
        ref = R.nf4_dequant(packed, qs).to(torch.float16)
        assert torch.equal(ref.view(torch.int16), bnbF.dequantize_4bit(packed, qs).view(torch.int16))


def test_attention_reference_is_causal_attention_of_each_row():
    torch.manual_seed(1)
    lengths = [3, 1, 2]
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    out = R.causal_attention_rows(q, k, v, lengths, 0.5)
    start = 0
    for n in lengths:
        qi, ki, vi = (t[0, start:start + n].transpose(0, 1) for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=0.5)
        assert torch.allclose(out[0, start:start + n], ref.transpose(0, 1))
        start += n


def test_lm_head_reference_is_cross_entropy():
    torch.manual_seed(2)
    h, w = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    labels = torch.tensor([[1, -100, 3], [4, 5, -100]])
    loss, entropy, logits = R.lm_head_loss(h, w, labels)
    flat = (h @ w.t()).reshape(-1, 10)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(flat, labels.reshape(-1), ignore_index=-100))
    p = flat.softmax(-1)
    assert torch.allclose(entropy.reshape(-1), -(p * p.log()).sum(-1))
