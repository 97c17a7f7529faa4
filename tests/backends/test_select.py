"""--device: the choices, CPU when asked, and auto/cuda on a machine without a usable GPU."""
import logging

import pytest
from click.testing import CliRunner

from strata.backends import cuda
from strata.backends.cpu import CpuModel
from strata.backends.select import build_model, check_device
from strata.cli import main
from strata.config import EngineConfig
from strata.errors import ConfigError
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model

needs_no_gpu = pytest.mark.skipif(cuda.is_available(), reason="this machine has a usable GPU")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("select") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", n_layers=2)
    return path


@pytest.mark.parametrize("name, expected", [(None, "auto"), ("CPU", "cpu"), (" cuda ", "cuda")])
def test_device_names(name, expected):
    assert check_device(name) == expected


def test_an_unknown_device_is_refused(tiny_path):
    with pytest.raises(ConfigError, match=r"--device 'gpu' is not one of auto, cpu, cuda"):
        EngineConfig(tiny_path, device="gpu")


def test_cpu_is_the_cpu_backend(tiny_path):
    with GGUFModel.open(tiny_path) as gguf:
        assert isinstance(build_model(gguf, "cpu"), CpuModel)


@needs_no_gpu
def test_auto_without_a_gpu_runs_on_the_cpu_and_says_why(tiny_path, caplog):
    with caplog.at_level(logging.INFO, logger="strata.engine"), GGUFModel.open(tiny_path) as gguf:
        assert isinstance(build_model(gguf, "auto"), CpuModel)
    assert "device auto: the CPU (no usable CUDA GPU" in caplog.text


@needs_no_gpu
def test_cuda_without_a_gpu_says_what_is_missing(tiny_path):
    with GGUFModel.open(tiny_path) as gguf, pytest.raises(ConfigError, match="--device cpu"):
        build_model(gguf, "cuda")


@needs_no_gpu
def test_cuda_with_the_expert_tier_says_what_is_missing(tiny_path):
    # the expert options no longer keep the GPU away: only the missing CUDA does
    with GGUFModel.open(tiny_path) as gguf, pytest.raises(ConfigError, match="--device cpu"):
        build_model(gguf, "cuda", needs_cpu_experts=True)


@needs_no_gpu
def test_auto_with_an_expert_cache_and_no_gpu_is_the_cpu(tiny_path, caplog):
    with caplog.at_level(logging.INFO, logger="strata.engine"), GGUFModel.open(tiny_path) as gguf:
        assert isinstance(build_model(gguf, "auto", needs_cpu_experts=True), CpuModel)
    assert "device auto: the CPU (no usable CUDA GPU" in caplog.text


def test_cli_device_option(tiny_path):
    runner = CliRunner()
    bad = runner.invoke(main, ["bench", "--model", str(tiny_path), "--device", "gpu", "-p", "8",
                               "-n", "2", "-r", "1"])
    assert bad.exit_code == 2 and "'gpu' is not one of" in bad.output
    ok = runner.invoke(main, ["bench", "--model", str(tiny_path), "--device", "cpu", "-p", "8",
                              "-n", "2", "-r", "1"])
    assert ok.exit_code == 0, ok.output
    header = ok.output.splitlines()[0]
    assert "| backend |" in header
    assert "| cpu " in ok.output.splitlines()[2]
