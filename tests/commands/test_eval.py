"""`posttrain eval` on the ~1M model: a model directory, a LoRA adapter and a trainer checkpoint; pass@k."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from posttrain.cli import main
from posttrain.commands.eval_metrics import pass_at_k, summarize
from posttrain.rewards.registry import default_compute_score

EVAL = ["--max-prompt-length", "64", "--max-response-length", "6", "--max-prompts", "8"]


def run_eval(model: Path, data: Path, out: Path, *extra: str) -> tuple[dict, list[dict]]:
    assert main(["eval", str(model), "--data", str(data), "--out", str(out), *EVAL, *extra]) == 0
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return results, samples


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_k_drawn_samples_hold_a_correct_one(n: int) -> None:
    """The estimator equals the exact share of k-subsets of the n samples that contain a correct one."""
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            exact = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(exact)
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)


def test_summarize_by_prompt_and_data_source() -> None:
    scores = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    out = summarize(scores, [1, 2], ["a", "a", "b"])
    assert out["accuracy"] == pytest.approx(0.5) and out["pass@1"] == pytest.approx(0.5)
    assert out["pass@2"] == pytest.approx((1 + 0 + 1) / 3)
    assert out["by_data_source"]["b"]["pass@2"] == 1.0
    with pytest.raises(ValueError, match="k must be"):
        summarize(scores, [3])


def test_eval_model_dir_writes_results_and_scored_samples(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    results, samples = run_eval(
        tiny_model_dir, arithmetic_data["test"], tmp_path / "e", "--n", "4", "--temperature", "1.0"
    )
    assert results["n_prompts"] == 8 and results["n_samples_per_prompt"] == 4
    assert {"accuracy", "mean_reward", "pass@1", "pass@2", "pass@4"} <= set(results)
    assert results["model"]["kind"] == "model"
    assert len(samples) == 32 and {s["sample"] for s in samples} == {0, 1, 2, 3}
    for s in samples:  # each score is the built-in scorer's on the stored response
        assert s["score"] == default_compute_score(s["data_source"], s["response"], s["ground_truth"], None)
    assert results["mean_reward"] == pytest.approx(sum(s["score"] for s in samples) / 32)
    again, _ = run_eval(
        tiny_model_dir, arithmetic_data["test"], tmp_path / "e2", "--n", "4", "--temperature", "1.0"
    )
    assert again["mean_reward"] == results["mean_reward"], "same seed, same samples"


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_eval_lora_adapter_equals_its_merged_model(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, targets: list[str]
) -> None:
    """With lm_head among its targets on a model whose head is tied to the embeddings (tiny's, Qwen2.5-0.5B's,
    Llama-3.2's), the adapter's head delta is the head's own: merged into the tied weight it changed the
    input embeddings too, and eval scored another model than the one trained."""
    from peft import LoraConfig, get_peft_model

    from posttrain.engine.lora import untie_output_embeddings
    from posttrain.models import load_causal_lm, load_tokenizer

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=targets, init_lora_weights=False)
    base = load_causal_lm(tiny_model_dir)
    if "lm_head" in targets:
        assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # tied
        untie_output_embeddings(base)  # the reference merge: the head's delta on the head alone
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    load_tokenizer(tiny_model_dir).save_pretrained(tmp_path / "merged")

    adapter, adapter_samples = run_eval(tmp_path / "adapter", arithmetic_data["test"], tmp_path / "a")
    merged, merged_samples = run_eval(tmp_path / "merged", arithmetic_data["test"], tmp_path / "m")
    _, base_samples = run_eval(tiny_model_dir, arithmetic_data["test"], tmp_path / "b")
    assert adapter["model"]["kind"] == "adapter"
    assert [s["response"] for s in adapter_samples] == [s["response"] for s in merged_samples]
    assert [s["response"] for s in adapter_samples] != [s["response"] for s in base_samples]


def test_eval_trainer_checkpoint(tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train = [
        f"model.path={tiny_model_dir}", f"data.train_files=[{arithmetic_data['train']}]",
        f"trainer.run_dir={run}", "trainer.total_steps=1", "trainer.backend=local", "trainer.val_before_train=false",
        "trainer.val_every=0", "data.train_batch_prompts=4", "rollout.n=2", "data.max_response_length=4",
        "trainer.loggers=[jsonl]", "actor.optim.lr=1e-2",
    ]  # fmt: skip
    assert main(["train", *train]) == 0
    results, samples = run_eval(run, arithmetic_data["test"], tmp_path / "c")
    assert results["model"]["kind"] == "checkpoint"
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    _, exported = run_eval(tmp_path / "hf", arithmetic_data["test"], tmp_path / "x")
    assert [s["response"] for s in samples] == [s["response"] for s in exported]
    # a save in progress (a live run) is left alone: export and eval only read (it was deleted, and the
    # run died); and a checkpoint whose config holds a key this version dropped still exports (the model
    # section is all export needs)
    in_progress = run / ".tmp-step_2" / "actor"
    in_progress.mkdir(parents=True)
    state_file = run / "step_1" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    state["config"]["actor"]["an_option_of_an_older_version"] = 1
    torch.save(state, state_file)
    assert main(["export", str(run), "--out", str(tmp_path / "hf2")]) == 0
    assert in_progress.is_dir()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--n", "2"], "--n > 1 needs --temperature > 0"),
        (["--n", "2", "--temperature", "1", "--k", "1,4"], "each k must be in [1, --n=2]"),
    ],
)
def test_eval_bad_settings_are_one_line(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    extra: list[str], message: str,
) -> None:  # fmt: skip
    argv = [
        "eval",
        str(tiny_model_dir),
        "--data",
        str(arithmetic_data["test"]),
        "--out",
        str(tmp_path),
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0


def test_eval_wrong_model_paths_say_what_to_give(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = ["--data", "x.parquet", "--out", str(tmp_path / "o")]
    assert main(["eval", str(tmp_path / "nowhere"), *data]) == 2
    assert "model path not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty"), *data]) == 2
    assert "not a model directory (no config.json), a LoRA adapter" in capsys.readouterr().err
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/X"}))
    assert main(["eval", str(tmp_path / "lora"), *data]) == 2
    assert "give --base DIR" in capsys.readouterr().err


def test_eval_runs_a_model_under_eager_attention_as_under_sdpa(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """--attn-implementation: a model transformers runs without sdpa (Gemma-2) is evaluated under eager; the
    same greedy answers either way."""
    _, sdpa = run_eval(tiny_model_dir, arithmetic_data["test"], tmp_path / "s")
    _, eager = run_eval(
        tiny_model_dir, arithmetic_data["test"], tmp_path / "e", "--attn-implementation", "eager"
    )
    assert [s["response"] for s in eager] == [s["response"] for s in sdpa]


def test_eval_renders_with_the_chat_template_arguments_and_reads_a_run_directorys_model(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """A run trained with data.apply_chat_template_kwargs (Qwen3's enable_thinking=false) validated on other
    prompts than eval rendered; `--chat-template-kwargs` (a checkpoint's own by default) renders alike. An
    offline trainer's run directory is evaluated through its hf/ model (it said "no tokenizer files")."""
    import shutil

    from tests.data.test_template_options import THINKING

    model = tmp_path / "run" / "hf"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    _, plain = run_eval(tmp_path / "run", arithmetic_data["test"], tmp_path / "a")
    results, quiet = run_eval(
        tmp_path / "run", arithmetic_data["test"], tmp_path / "b", "--chat-template-kwargs", '{"enable_thinking": false}'
    )  # fmt: skip
    assert not plain[0]["prompt"].endswith("</think>\n\n")
    assert all(s["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for s in quiet)
    assert results["model"]["chat_template_kwargs"] == {"enable_thinking": False}
