"""What a run records of where its numbers were computed (issue #35): the CPU, its instruction set, the threads and
the kernels' libraries — the things that change the last digits of a float result between machines."""

import torch

from flatbma.experiment.run import provenance
from flatbma.experiment.run.provenance import environment

MKL_BUILD = """PyTorch built with:
  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64 architecture
  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)
  - CPU capability usage: AVX512
  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=mkl, USE_MKL=ON,
"""
OPENBLAS_BUILD = """PyTorch built with:
  - oneDNN v3.7.1 (Git Hash 8d263e693366ef8db40acc569cc7d8edf644556d)
  - Build settings: BLAS_INFO=open, BUILD_TYPE=Release, LAPACK_INFO=open,
"""


def test_the_backends_are_read_from_torchs_build_text():
    assert provenance._backends(MKL_BUILD) == {"blas": "mkl", "mkl": "2024.2-Product", "onednn": "v3.12.0"}
    assert provenance._backends(OPENBLAS_BUILD) == {"blas": "open", "mkl": None, "onednn": "v3.7.1"}
    assert provenance._backends("") == {"blas": None, "mkl": None, "onednn": None}


def test_the_record_holds_the_cpu_its_isa_the_threads_and_the_variables_that_change_kernels(monkeypatch):
    monkeypatch.setattr(
        provenance, "_cpuinfo", lambda: "model name\t: Some CPU 9000\nflags\t\t: fpu sse4_2 avx avx2 fma\n"
    )
    for name in provenance.KERNEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # read when recorded (torch read it when it started)
    record = environment("cpu")
    assert record["cpu"] == "Some CPU 9000"
    assert record["cpu_flags"] == ["sse4_2", "avx", "avx2", "fma"]  # in ISA_FLAGS' order, nothing else
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["threads"] == torch.get_num_threads()
    assert record["kernel_variables"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert record["blas"] == provenance._backends(torch.__config__.show())["blas"]
    assert "gpu" not in record
    for key in ("flatbma", "torch", "numpy", "python", "interop_threads", "cpu_count", "mkl", "onednn"):
        assert key in record
