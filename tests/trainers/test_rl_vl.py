"""RL (GRPO) with a vision-language policy on image prompts (tiny-vl, the shapes task's verl multimodal rows).

Fast: the trainer reads multimodal rows (images in the Batch column, image tokens counted against
data.max_prompt_length); each row's images stay with it through the group repeat, the worker balancing, the
mini-batch split and the engine's micro-batches (the update's log-probs equal a per-row computation with the HF
model); what does not carry images is refused naming the key. Slow: SFT warm start, then `posttrain train`
(GRPO) on 2 Ray workers, sampler and trainer log-probs within 1e-4 on every step, weights moved.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageDraw

from posttrain.agents.image_env import look_and_answer_rows
from posttrain.cli import main
from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig, SFTConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS, MultimodalPromptDataset
from posttrain.data.tasks.shapes import write_shapes_dataset
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError, DataError
from posttrain.models import is_vision_language, load_causal_lm
from posttrain.models.vl import vision_tower
from posttrain.rollout.base import GenerationResult
from posttrain.trainers.checks import check_rl_config
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.sft import SFTTrainer
from posttrain.trainers.updates import balance_across_workers
from posttrain.workers.losses import LossSpec, build_loss
from posttrain.workers.sampling import results_batch
from tests.agents.test_image_observations import ONE_TOKEN_TURNS

# the RL tests' rows are padded (packed rows equal them: tests/engine/test_packed_images.py); no shared prompts
PADDED = ["model.remove_padding=false", "model.share_prompt=false"]


@pytest.fixture(scope="module")
def vl_dir(tiny_vl_dir: Path) -> Path:
    return tiny_vl_dir


def png(size: tuple[int, int], color: str, box: tuple[int, int, int, int]) -> dict:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle(box, fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shapes-task rows whose images differ in size and number (4, 8, 0, 4 + 8 and 8 image tokens), so a row
    that received another row's images would fail the engine's count check or change its log-probs."""

    def row(i: int, text: str, images: list, answer: str) -> dict:
        return {
            "data_source": "shapes",
            "prompt": [{"role": "user", "content": text}],
            "images": images,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": i, "answer": answer},
        }

    question = "How many squares are in the image? Answer with one word or number."
    rows = [
        row(0, f"<image>{question}", [png((56, 56), "red", (4, 4, 20, 20))], "1"),
        row(1, f"<image>{question}", [png((112, 56), "blue", (30, 10, 60, 40))], "1"),
        row(2, "How many squares are in no image?", [], "0"),
        row(
            3,
            f"<image> and <image>{question}",
            [png((56, 56), "green", (2, 2, 30, 30)), png((56, 112), "red", (0, 0, 9, 9))],
            "2",
        ),  # fmt: skip
        row(4, f"<image>{question}", [png((56, 112), "yellow", (10, 10, 40, 40))], "1"),
    ]
    path = tmp_path_factory.mktemp("rows") / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def rl_config(vl_dir: Path, train: Path, run_dir: Path, *extra: str) -> RLConfig:
    return load_config(
        RLConfig,
        "rl",
        [
            f"model.path={vl_dir}",
            f"data.train_files=[{train}]",
            f"trainer.run_dir={run_dir}",
            "trainer.backend=local",
            "data.max_prompt_length=128",
            "data.max_response_length=4",
            "data.train_batch_prompts=5",
            "data.shuffle=false",
            "rollout.n=2",
            "trainer.val_before_train=false",
            "trainer.val_every=0",
            *PADDED,
            *extra,
        ],
    )


def test_trainer_reads_multimodal_rows(vl_dir: Path, rows_file: Path, tmp_path: Path) -> None:
    trainer = RLTrainer(rl_config(vl_dir, rows_file, tmp_path))
    assert isinstance(trainer.train_set, MultimodalPromptDataset)
    batch = trainer.loader.next_batch()
    image_id = load_causal_lm(vl_dir).config.image_token_id
    grids = [mm["image_grid_thw"].tolist() if mm else [] for mm in batch[MULTI_MODAL_INPUTS]]
    assert grids == [[[1, 4, 4]], [[1, 4, 8]], [], [[1, 4, 4], [1, 8, 4]], [[1, 8, 4]]]
    tokens = (batch[keys.INPUT_IDS] == image_id).sum(1).tolist()
    assert tokens == [4, 8, 0, 12, 8]  # one per merged 2x2 patch, expanded from each <image> placeholder
    assert list(batch[keys.DATA_SOURCE]) == ["shapes"] * 5


def test_image_tokens_count_against_max_prompt_length(vl_dir: Path, rows_file: Path, tmp_path: Path) -> None:
    """Row 3's 12 image tokens push it over a limit the text alone fits in: an error naming the row and the
    key with overlong_prompts=error, else the row is dropped."""
    dataset = RLTrainer(rl_config(vl_dir, rows_file, tmp_path / "a")).train_set
    lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    longest_other = max(n for i, n in enumerate(lengths) if i != 3)
    assert lengths[3] - 12 <= longest_other < lengths[3]
    limit = [f"data.max_prompt_length={longest_other}", "data.train_batch_prompts=2"]
    with pytest.raises(DataError, match=r"row 3: prompt has \d+ tokens \(12 of them for 2 images\).*data.max_prompt_length"):  # fmt: skip
        RLTrainer(rl_config(vl_dir, rows_file, tmp_path / "b", *limit, "data.overlong_prompts=error"))
    trainer = RLTrainer(rl_config(vl_dir, rows_file, tmp_path / "c", *limit))
    assert len(trainer.train_set) == 4 and trainer.train_set.n_filtered == 1


class EngineActor:
    """The actor group's update verbs on one in-process engine; records each mini-batch it is given. No
    optimizer step, so every mini-batch is scored by the weights the reference log-probs were computed with."""

    # the group the rows are balanced for: each mini-batch is balanced over its 2 ranks too
    data_parallel_size = 2

    def __init__(self, engine: TrainEngine) -> None:
        self.engine = engine
        self.mini_batches: list[Batch] = []

    def forward_backward(self, batch: Batch, loss: LossSpec, *, temperature: float = 1.0) -> dict[str, float]:
        self.mini_batches.append(batch)
        return self.engine.forward_backward(batch, build_loss(loss, 1), temperature=temperature)

    def optim_step(self) -> dict[str, float]:
        self.engine.optimizer.zero_grad(set_to_none=True)
        return {}


def per_row_log_probs(model: torch.nn.Module, batch: Batch, image_id: int) -> torch.Tensor:
    """Each response token's log-prob from the HF model called on that row alone, with that row's images."""
    width = batch[keys.RESPONSES].shape[1]
    out = torch.zeros(len(batch), width)
    with torch.no_grad():
        for r in range(len(batch)):
            prompt = batch[keys.PROMPTS][r][batch[keys.ATTENTION_MASK][r, :-width].bool()]
            n = int(batch[keys.RESPONSE_MASK][r].sum())
            ids = torch.cat([prompt, batch[keys.RESPONSES][r, :n]])[None]
            mm = batch[MULTI_MODAL_INPUTS][r]
            extra = dict(mm, mm_token_type_ids=(ids == image_id).int()) if mm else {}
            logits = model(input_ids=ids, **extra).logits[0, len(prompt) - 1 : -1]
            out[r, :n] = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    return out


@pytest.mark.parametrize(
    ("remove_padding", "share_prompt"),
    [(False, False), (True, False), (True, True)],
    ids=["padded", "packed", "shared"],
)
@pytest.mark.parametrize("split", ["micro_batch_size", "token_budget"])
def test_images_stay_with_their_rows_through_the_update_split(
    vl_dir: Path, rows_file: Path, tmp_path: Path, split: str, remove_padding: bool, share_prompt: bool
) -> None:
    """The step's rows as the trainer builds them (prompts repeated for the n samples, responses appended, rows
    balanced over 2 workers), updated in 2 mini-batches of micro-batches of 2 rows (or of a token budget that
    regroups rows), padded, packed or packed with shared prompts: every mini-batch carries its rows' images, and
    the log-probs the update computes equal a per-row HF computation (`rollout/logprob_diff_max`)."""
    trainer = RLTrainer(rl_config(vl_dir, rows_file, tmp_path, "actor.mini_batch_size=5"))
    prompts = trainer.loader.next_batch()
    rows = prompts.repeat(trainer.cfg.rollout.n, interleave=True)
    for r in range(0, len(rows), 2):  # the n samples of a group carry their prompt's images (the same object)
        assert rows[MULTI_MODAL_INPUTS][r] is rows[MULTI_MODAL_INPUTS][r + 1]
    gen = torch.Generator().manual_seed(0)
    results = [
        GenerationResult(torch.randint(3, 200, (1 + r % 4,), generator=gen).tolist(), [0.0] * (1 + r % 4), "", "stop")
        for r in range(len(rows))
    ]  # fmt: skip
    batch = results_batch(rows, results, trainer.pad_id, 4, 0.0, 1.0).union(rows.select(tensor_keys=[]))
    model = load_causal_lm(vl_dir)
    reference = per_row_log_probs(model, batch, model.config.image_token_id)
    batch.set(keys.ROLLOUT_LOG_PROBS, reference)
    batch.set(keys.REF_LOG_PROB, reference)  # the KL loss is on by default: zero against the same model
    batch.set(keys.ADVANTAGES, torch.randn(len(batch), 4, generator=gen))
    batch, _ = balance_across_workers(batch, 2)  # reorders rows by length
    budget = {"micro_batch_size": 2, "max_token_len": 0}
    if split == "token_budget":
        budget = {"micro_batch_size": 64, "max_token_len": 2 * int(batch[keys.ATTENTION_MASK].sum(1).max())}
    engine = TrainEngine(
        EngineConfig(
            model_path=str(vl_dir), remove_padding=remove_padding, share_prompt=share_prompt, **budget
        )
    )
    actor = EngineActor(engine)
    trainer.actor, trainer.rollout = actor, object()  # type: ignore[assignment]
    metrics = trainer.update(batch)
    assert len(actor.mini_batches) == 2
    for mb in actor.mini_batches:
        assert MULTI_MODAL_INPUTS in mb
        assert len(engine._micro_batch_rows(mb)) > 1
        for r in range(len(mb)):
            mm = mb[MULTI_MODAL_INPUTS][r]
            n_image = int((mb[keys.INPUT_IDS][r] == model.config.image_token_id).sum())
            assert n_image == (int(mm["image_grid_thw"].prod(-1).sum()) // 4 if mm else 0)
    assert metrics["rollout/logprob_diff_max"] < 1e-5
    assert abs(metrics["actor/kl_loss"]) < 1e-5
    assert math.isfinite(metrics["actor/loss"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*PADDED, "model.sequence_parallel_size=2"], "model.sequence_parallel_size=2 is not supported"),
        ([*PADDED, "rollout.name=hf"], "rollout.name=hf cannot sample image prompts"),
        ([*PADDED, "algorithm=ppo"], "critic.enable=true: the critic's value head does not take images"),
        ([*PADDED, "reward.model.path=/x"], "reward.model.path is set"),
        ([*PADDED, "distill.teacher_path=/x"], "distill.teacher_path is set"),
        ([*PADDED, "async_rl.staleness=1"], "async_rl.staleness >= 1"),
    ],
)
def test_what_does_not_carry_images_is_refused(
    vl_dir: Path, rows_file: Path, overrides: list[str], message: str
) -> None:
    cfg = load_config(RLConfig, "rl", [f"model.path={vl_dir}", f"data.train_files=[{rows_file}]", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_rl_config(cfg)


@pytest.mark.parametrize("share_prompt", [[], ["model.share_prompt=false"]], ids=["defaults", "unshared"])
def test_grpo_steps_on_packed_rows(
    vl_dir: Path, rows_file: Path, tmp_path: Path, share_prompt: list[str]
) -> None:
    """`posttrain train` on rl.yaml's model defaults (packed rows, `model.share_prompt=true`: the n samples of
    an image prompt share one prompt pass) and with shared prompts off, one in-process worker: 2 GRPO steps on
    image prompts, the trainer's packed log-probs equal the sampler's."""
    run = tmp_path / "run"
    args = [
        f"model.path={vl_dir}",
        f"data.train_files=[{rows_file}]",
        f"trainer.run_dir={run}",
        *share_prompt,
        "trainer.backend=local",
        "trainer.threads_per_worker=1",
        "trainer.total_steps=2",
        "trainer.val_before_train=false",
        "trainer.val_every=0",
        "trainer.plots=false",
        "trainer.loggers=[jsonl]",
        "data.train_batch_prompts=5",
        "data.max_prompt_length=128",
        "data.max_response_length=4",
        "rollout.n=2",
        "actor.micro_batch_size=4",
    ]
    assert main(["train", *args]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-5
        assert math.isfinite(r["actor/loss"]) and r["actor/skipped_nonfinite"] == 0


@pytest.mark.parametrize("remove_padding", [False, True])
def test_grpo_on_agent_episodes_that_show_images(
    vl_dir: Path, rows_file: Path, tmp_path: Path, remove_padding: bool
) -> None:
    """`agent.enable=true`: the shapes rows' image prompts run as single-turn episodes, the look-and-answer rows
    (posttrain/agents/image_env.py) as 2-turn episodes whose first and second observations each show an image.
    2 GRPO steps on padded and on packed rows: every training row carries its episode's images (its image
    tokens, never trained, number what its own images give), and the trainer's log-probs equal the sampler's."""
    looks = [dict(r, agent_name=ONE_TOKEN_TURNS, images=[]) for r in look_and_answer_rows(2, turns=2)]
    train = tmp_path / "agent_rows.parquet"
    shapes = [dict(r, agent_name=None) for r in pq.read_table(rows_file).to_pylist()[:2]]  # single_turn
    pq.write_table(pa.Table.from_pylist(shapes + looks), train)
    # the untrained model's one-token answers are rarely right: a reward by the answer's parity gives the groups
    # rewards that differ, so the update has a gradient on the image rows
    scorer = tmp_path / "parity.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 2)\n"
    )
    run = tmp_path / "run"
    cfg = rl_config(
        vl_dir,
        train,
        run,
        f"reward.custom_function_path={scorer}",
        f"model.remove_padding={str(remove_padding).lower()}",
        "data.train_batch_prompts=4",
        "agent.enable=true",
        "agent.max_turns=3",
        "agent.max_total_tokens=256",
        "trainer.total_steps=2",
        "trainer.threads_per_worker=1",
        "trainer.loggers=[jsonl]",
        "trainer.plots=false",
        f"data.val_files=[{train}]",  # validation runs the same episodes, one per row
        "trainer.val_every=2",
    )
    trainer = RLTrainer(cfg)
    assert trainer.agents is not None
    batches: list[Batch] = []
    step_batch = trainer.agents.step_batch

    def recording(*args: object, **kwargs: object) -> tuple[Batch, dict[str, float]]:
        batch, metrics = step_batch(*args, **kwargs)  # type: ignore[arg-type]
        batches.append(batch)
        return batch, metrics

    trainer.agents.step_batch = recording  # type: ignore[method-assign]
    (validation,) = trainer.fit()
    assert validation["val/agent/turns_mean"] == pytest.approx(1.5) and 0.0 <= validation["val/acc"] <= 1.0
    image_id = load_causal_lm(vl_dir).config.image_token_id
    for batch in batches:
        assert len(batch) == 8  # 4 rows x rollout.n episodes, one row each
        for r in range(len(batch)):
            mm = batch[MULTI_MODAL_INPUTS][r]
            seen = batch[keys.INPUT_IDS][r][batch[keys.ATTENTION_MASK][r].bool()]
            assert int((seen == image_id).sum()) == int(mm["image_grid_thw"].prod(-1).sum()) // 4
            in_response = batch[keys.RESPONSES][r] == image_id
            assert not (batch[keys.RESPONSE_MASK][r].bool() & in_response).any()
            looked = batch[keys.EXTRA_INFO][r].get("seed") is not None
            assert mm["image_grid_thw"].shape[0] == (2 if looked else 1)
            assert bool(in_response.any()) == looked  # the second image came in a later observation
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-4  # the actor's pass read the images that were sampled
        assert r["agent/turns_mean"] == pytest.approx(1.5)  # half the episodes took 2 turns
        assert math.isfinite(r["actor/loss"])
    assert any(r["actor/grad_norm"] > 0 for r in steps)


# ---- end to end ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_shapes_dataset(
        tmp_path_factory.mktemp("shapes"), n_train=256, n_test=32, kind="count", seed=0
    )


@pytest.fixture(scope="module")
def warm(vl_dir: Path, shapes: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 SFT steps on the shapes count task (tests/trainers/test_sft_vl.py's settings): the model then answers
    with a count, so GRPO's groups get rewards that differ."""
    run_dir = tmp_path_factory.mktemp("sft")
    cfg = load_config(
        SFTConfig,
        "sft",
        [
            f"model.path={vl_dir}",
            f"data.train_files=[{shapes['train']}]",
            f"trainer.run_dir={run_dir}",
            "model.remove_padding=false",
            "data.max_prompt_length=128",
            "trainer.threads_per_worker=1",
            "trainer.plots=false",
            "trainer.val_every=0",
            "optim.batch_size=16",
            "optim.micro_batch_size=8",
            "optim.warmup_steps=3",
            "trainer.total_steps=30",
        ],
    )
    trainer = SFTTrainer(cfg)
    trainer.fit()
    return trainer.hf_dir


def language_weights(path: Path) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone() for n, p in load_causal_lm(path).named_parameters() if ".visual." not in f".{n}"
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", [PADDED, []], ids=["padded", "defaults"])
def test_grpo_on_shapes_with_tiny_vl_on_two_ray_workers(
    warm: Path, shapes: dict, tmp_path: Path, ray_cluster: None, layout: list[str]
) -> None:
    """`posttrain train` from an SFT warm start: 3 GRPO steps on 2 FSDP workers with the shapes scorer, KL to the
    reference (its pass takes the images), 2 mini-batches per step (the old-log-prob pass too), micro-batches of
    2 rows; validation on held-out image prompts; the checkpoint exports as a vision-language model. Padded
    rows, and rl.yaml's defaults (packed rows, shared prompts)."""
    run = tmp_path / "run"
    args = [
        f"model.path={warm}",
        f"data.train_files=[{shapes['train']}]",
        f"data.val_files=[{shapes['test']}]",
        f"trainer.run_dir={run}",
        *layout,
        "trainer.backend=ray",
        "trainer.n_workers_per_node=2",
        "trainer.threads_per_worker=1",
        "trainer.total_steps=3",
        "trainer.val_every=3",
        "trainer.plots=false",
        "trainer.loggers=[jsonl]",
        "data.val_max_prompts=16",
        "data.train_batch_prompts=4",
        "data.max_prompt_length=128",
        "data.max_response_length=4",
        "rollout.n=4",
        "actor.mini_batch_size=8",
        "actor.micro_batch_size=2",
        "actor.use_kl_loss=true",
        "actor.optim.lr=1e-3",
    ]
    assert main(["train", *args]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-4  # the sampler and the trainer read the same images
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert math.isfinite(r[key]), key
        assert r["actor/skipped_nonfinite"] == 0
    assert any(r["actor/grad_norm"] > 0 for r in steps)
    assert 0.0 <= logged[-1]["val/acc"] <= 1.0 and "val/acc/shapes" in logged[-1]
    assert main(["export", str(run / "step_3"), "--out", str(tmp_path / "hf")]) == 0
    assert is_vision_language(tmp_path / "hf")
    before, after = language_weights(warm), language_weights(tmp_path / "hf")
    assert before.keys() == after.keys()
    assert sum(not torch.equal(before[n], after[n]) for n in before) > len(before) // 2


@pytest.mark.slow
def test_grpo_with_lora_on_images(warm: Path, shapes: dict, tmp_path: Path) -> None:
    """LoRA: the reference is the base model with the adapter disabled, its pass on the same images; the
    merged weights reach the sampler (log-probs still agree after the first update)."""
    run = tmp_path / "run"
    cfg = rl_config(
        warm,
        shapes["train"],
        run,
        "data.train_batch_prompts=4",
        "rollout.n=4",
        "trainer.total_steps=2",
        "trainer.threads_per_worker=2",
        "trainer.loggers=[jsonl]",
        "trainer.plots=false",
        "model.lora.rank=8",
        "actor.optim.lr=1e-2",
        "actor.use_kl_loss=true",
    )
    RLTrainer(cfg).fit()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in steps)
    assert steps[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # adapter B = 0: policy == reference
    assert steps[1]["actor/grad_norm"] > 0 and steps[1]["actor/kl_loss"] > 0  # moved away from the base


BOUNDS = ["data.min_pixels=784", "data.max_pixels=3136"]  # 28x28 .. 56x56: tiny-vl's own are 56x56 .. 112x112


def image_tokens(batch: Batch, image_id: int) -> list[int]:
    return (batch[keys.INPUT_IDS] == image_id).sum(1).tolist()


def test_pixel_bounds_reach_the_images_their_token_counts_and_the_engine(
    vl_dir: Path, rows_file: Path, tmp_path: Path
) -> None:
    """`data.max_pixels` below the model's own: the train and validation prompts' images are resized within the
    bounds (grids of at most 3136 pixels), each gives fewer image tokens, the prompt lengths counted against
    data.max_prompt_length are the shorter ones (a limit the model's bounds exceed now holds every row), and the
    train engine's pass on the step's rows (its check of each row's image tokens against its grids) equals a
    per-row HF computation on the same pixels."""
    image_id = load_causal_lm(vl_dir).config.image_token_id
    default = RLTrainer(rl_config(vl_dir, rows_file, tmp_path / "a")).loader.next_batch()
    bounded_trainer = RLTrainer(
        rl_config(vl_dir, rows_file, tmp_path / "b", *BOUNDS, f"data.val_files=[{rows_file}]")
    )
    bounded = bounded_trainer.loader.next_batch()
    assert image_tokens(default, image_id) == [4, 8, 0, 12, 8]
    assert image_tokens(bounded, image_id) == [4, 3, 0, 7, 3]  # 112x56 -> 84x28: 3 tokens
    for mm in bounded[MULTI_MODAL_INPUTS]:
        if mm:
            assert all(h * w * 14 * 14 <= 3136 for _, h, w in mm["image_grid_thw"].tolist())
    assert bounded_trainer.val_set is not None
    val = [
        bounded_trainer.val_set[i]["input_ids"].count(image_id) for i in range(len(bounded_trainer.val_set))
    ]
    assert val == [4, 3, 0, 7, 3]
    longest = int(bounded[keys.ATTENTION_MASK].sum(1).max())
    limit = [f"data.max_prompt_length={longest}", "data.overlong_prompts=error", "data.train_batch_prompts=5"]
    with pytest.raises(DataError, match="data.max_prompt_length"):
        RLTrainer(rl_config(vl_dir, rows_file, tmp_path / "c", *limit))
    assert len(RLTrainer(rl_config(vl_dir, rows_file, tmp_path / "d", *limit, *BOUNDS)).train_set) == 5

    rows = bounded.repeat(2, interleave=True)
    gen = torch.Generator().manual_seed(0)
    results = [
        GenerationResult(torch.randint(3, 200, (1 + r % 4,), generator=gen).tolist(), [0.0] * (1 + r % 4), "", "stop")
        for r in range(len(rows))
    ]  # fmt: skip
    batch = results_batch(rows, results, bounded_trainer.pad_id, 4, 0.0, 1.0).union(
        rows.select(tensor_keys=[])
    )
    want = per_row_log_probs(load_causal_lm(vl_dir), batch, image_id)
    for packed in (False, True):  # padded rows; packed rows with shared prompts (the RL defaults)
        engine = TrainEngine(
            EngineConfig(
                model_path=str(vl_dir), remove_padding=packed, share_prompt=packed, micro_batch_size=4
            )
        )
        got = engine.compute_log_prob(batch) * batch[keys.RESPONSE_MASK]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.min_pixels=0"], r"data.min_pixels=0: an image's area in pixels, must be a positive integer"),
        (["data.max_pixels=-1"], r"data.max_pixels=-1: an image's area"),
        (
            ["data.min_pixels=5000", "data.max_pixels=4000"],
            r"data.min_pixels=5000 is above data.max_pixels=4000",
        ),
        (["data.min_pixels=20000"], r"data.min_pixels=20000 is above the model's max_pixels=12544"),
        (["data.max_pixels=1000"], r"the model's min_pixels=3136 is above data.max_pixels=1000"),
    ],
)
def test_pixel_bounds_are_checked_at_start(
    vl_dir: Path, rows_file: Path, tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        RLTrainer(rl_config(vl_dir, rows_file, tmp_path, *overrides))


def test_pixel_bounds_on_a_text_model_are_refused(tiny_model_dir: Path, arithmetic_data: dict) -> None:
    cfg = load_config(
        RLConfig,
        "rl",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arithmetic_data['train']}]",
            "data.max_pixels=3136",
        ],
    )
    with pytest.raises(ConfigError, match=r"data.max_pixels=3136 set, but model.path=.* has no vision tower"):
        check_rl_config(cfg)


def moved(base: Path, trained: Path) -> tuple[list[bool], bool]:
    """(for each vision-tower weight, whether it changed; whether the language model changed)."""
    a, b = load_causal_lm(base), load_causal_lm(trained)
    tower = [
        not torch.equal(p, q)
        for p, q in zip(vision_tower(a).parameters(), vision_tower(b).parameters(), strict=True)
    ]
    lm = [
        not torch.equal(p, q)
        for p, q in zip(a.model.language_model.parameters(), b.model.language_model.parameters(), strict=True)
    ]
    return tower, any(lm)


@pytest.mark.parametrize("mode", ["frozen", "trained"])
def test_model_vision_tower_reaches_the_grpo_engine(
    vl_dir: Path, pretrained_vl_dir: Path, rows_file: Path, tmp_path: Path, mode: str
) -> None:
    """`model.vision_tower` in `posttrain train`: `frozen` on a from-scratch model (which `auto` trains) leaves
    every tower weight as it was after a GRPO step while the language model moves; `trained` on a pretrained
    model (which `auto` freezes) moves every tower weight. A reward by the answer's parity gives the groups
    rewards that differ, so the step has a gradient."""
    base = vl_dir if mode == "frozen" else pretrained_vl_dir
    scorer = tmp_path / "parity.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 2)\n"
    )
    run = tmp_path / "run"
    args = [
        f"model.path={base}",
        f"model.vision_tower={mode}",
        f"data.train_files=[{rows_file}]",
        f"trainer.run_dir={run}",
        f"reward.custom_function_path={scorer}",
        "trainer.backend=local",
        "trainer.threads_per_worker=1",
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "trainer.val_every=0",
        "trainer.plots=false",
        "trainer.loggers=[jsonl]",
        "data.train_batch_prompts=5",
        "data.max_prompt_length=128",
        "data.max_response_length=4",
        "rollout.n=4",
        "actor.optim.lr=1e-2",
    ]
    assert main(["train", *args]) == 0
    assert main(["export", str(run / "step_1"), "--out", str(tmp_path / "hf")]) == 0
    tower, lm = moved(base, tmp_path / "hf")
    assert lm
    assert all(tower) if mode == "trained" else not any(tower)
