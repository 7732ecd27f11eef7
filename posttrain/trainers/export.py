"""`posttrain export`: a checkpoint of an RL run to a Hugging Face directory (full, merged, or adapter).

Runs in one process at world size 1 whatever the world size that wrote the checkpoint: torch.distributed
checkpoint reshards FSDP2 shards on load.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config.load import from_dict
from posttrain.config.schema_shared import ModelConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.trainers.checkpoint import STATE_FILE, CheckpointManager
from posttrain.trainers.setup import engine_config


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder (`step_N`), or a run directory (its `latest` checkpoint)."""
    path = Path(path)
    if (path / STATE_FILE).exists():
        return path
    latest = CheckpointManager(path).latest() if path.is_dir() else None
    if latest is None:
        raise ConfigError(f"{path} is neither a checkpoint (no {STATE_FILE}) nor a run directory with one")
    return latest


def export_checkpoint(checkpoint: str | Path, out: str | Path, adapter_only: bool = False) -> Path:
    """Write the policy of `checkpoint` to `out`; with LoRA, merged into the base unless `adapter_only`."""
    path = resolve_checkpoint(checkpoint)
    state = CheckpointManager(path.parent).load_state(path)
    if state.get("trainer") == "rm":
        raise ConfigError(
            f"{path} is a reward model's checkpoint (posttrain rm); `posttrain export` writes policies: the "
            f"trained reward model is {path.parent / 'hf'} (trainer.save_hf_dir), written when the run ends"
        )
    # the model section only: a checkpoint of an older version, whose other sections hold keys since
    # renamed or dropped, still exports
    model = from_dict(ModelConfig, state["config"]["model"])
    if adapter_only and model.lora.rank <= 0:
        raise ConfigError(f"--adapter: the run of {path} trained the full model (model.lora.rank=0)")
    # one process reads the whole checkpoint: the run's sequence parallelism does not apply here
    engine = TrainEngine(engine_config(model, trainable=False, sequence_parallel_size=1))
    engine.load(path / "actor")
    engine.export_hf(out, merged=not adapter_only)
    return Path(out)
