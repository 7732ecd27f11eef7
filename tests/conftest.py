"""Session fixtures shared by the engine, rollout, controller and trainer tests.

The tiny model and task data are built once per session; Ray is started once (loopback only) and only by
tests that ask for it, because a start costs several seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~1M-parameter Qwen2 directory with a tokenizer trained on the arithmetic task."""
    from posttrain.data.tasks.arithmetic import corpus
    from posttrain.models import make_tiny_model

    return make_tiny_model("tiny", tmp_path_factory.mktemp("models") / "tiny", corpus(3000, seed=0))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~1.2M-parameter Qwen2-MoE directory (4 experts, top-2) on the same arithmetic tokenizer."""
    from posttrain.data.tasks.arithmetic import corpus
    from posttrain.models import make_tiny_model

    return make_tiny_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe", corpus(3000, seed=0))


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-vl preset (Qwen2-VL, ~0.7M parameters) with a tokenizer trained on the shapes task."""
    from posttrain.data.tasks.shapes import corpus
    from posttrain.models import make_tiny_model

    return make_tiny_model("tiny-vl", tmp_path_factory.mktemp("models") / "tiny-vl", corpus(2000), seed=0)


@pytest.fixture(scope="module")
def pretrained_vl_dir(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's `vl_dir` without make-model's from-scratch marker, as a downloaded model would be:
    `model.vision_tower=auto` freezes its tower."""
    import json
    import shutil

    from posttrain.models.vl import FROM_SCRATCH_KEY

    out = tmp_path_factory.mktemp("pretrained") / "model"
    shutil.copytree(vl_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.pop(FROM_SCRATCH_KEY)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from posttrain.data.tasks.arithmetic import write_arithmetic_dataset

    return write_arithmetic_dataset(tmp_path_factory.mktemp("data"), n_train=512, n_test=32, max_digits=2)


@pytest.fixture(scope="session")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward model with a tokenizer of its own (trained on another task's texts than the policy's): the
    tiny preset's sequence classifier with a fresh score head."""
    from posttrain.data.tasks.long_addition import corpus as long_addition_corpus
    from posttrain.engine.reward_engine import load_reward_model
    from posttrain.models import load_tokenizer, make_tiny_model

    base = make_tiny_model(
        "tiny", tmp_path_factory.mktemp("rm_base") / "m", long_addition_corpus(2000, seed=1)
    )
    out = tmp_path_factory.mktemp("rm") / "rm"
    load_reward_model(base).save_pretrained(out)
    load_tokenizer(base).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def ray_cluster() -> None:
    """A local, loopback-only Ray for the whole session, with its files in a folder of our own."""
    from posttrain.controller.ray_env import start_ray, stop_ray

    start_ray(num_cpus=4, tmpdir=f"/tmp/pt-ray-test-{os.getpid()}")
    yield
    stop_ray()
