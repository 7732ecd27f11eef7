"""GKD on the actor worker: the student's and the frozen teacher's full-vocabulary logits in one process.

`DistillWorker` is the actor worker (training engine, optional sampler for student-generated batches) with
a teacher engine (`ActorRolloutRefSpec.teacher`); `gkd` runs both models on each micro-batch of right-padded
rows (input_ids, attention_mask, position_ids, loss_mask) and takes the generalised Jensen-Shannon divergence
(algorithms/distillation.py) at every position whose next token carries loss. The logits never leave the
worker: only metrics do. A plain class the controller wraps as a Ray actor or runs in-process.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from posttrain.algorithms.distillation import generalized_jsd
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.fsdp import reshard_all
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.workers.actor_rollout_ref import ActorRolloutRefWorker


def _logits(engine: TrainEngine, mb: Batch) -> torch.Tensor:
    out = engine.model(
        input_ids=mb[keys.INPUT_IDS],
        attention_mask=mb[keys.ATTENTION_MASK],
        position_ids=mb[keys.POSITION_IDS],
    )
    return out.logits


class DistillWorker(ActorRolloutRefWorker):
    """The actor worker with the GKD verb; needs a spec with `teacher` set."""

    def gkd(self, batch: Batch, beta: float, temperature: float, backward: bool = True) -> dict[str, float]:
        """sum over loss tokens of JSD_beta(teacher || student) / `global_tokens` (the whole batch's loss tokens,
        meta), plus a MoE student's router load-balancing loss (`model.router_aux_loss_coef` times its mean over
        the micro-batches, as the training engine adds it), accumulated into the gradients when `backward`
        (then `optim_step`); metrics are this rank's token means: `distill/jsd` and the full-vocabulary
        `distill/kl_to_teacher` = KL(student || teacher), and `actor/router_aux_loss` for a MoE student."""
        if self.teacher is None:
            raise ConfigError("gkd needs a teacher (ActorRolloutRefSpec.teacher)")
        if self.rollout is not None:
            self.rollout.sleep()
        engine, model = self.actor, self.actor.model
        size = engine.config.micro_batch_size
        micro = [batch.index(list(range(i, min(i + size, len(batch))))) for i in range(0, len(batch), size)]
        global_tokens = float(batch.meta.get(keys.GLOBAL_TOKENS, float(batch[keys.LOSS_MASK][:, 1:].sum())))
        keep_gathered = engine.mesh.size() == 1
        sums = {"jsd": 0.0, "kl": 0.0, "tokens": 0.0, "router_aux": 0.0}
        was_training = model.training
        if not backward:
            model.eval()
        try:
            for i, mb in enumerate(micro):
                mb = mb.to(engine.device)
                last = i == len(micro) - 1
                if backward:  # reduce-scatter gradients once, after the last micro-batch
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last or not keep_gathered)
                with torch.no_grad():
                    teacher = _logits(self.teacher, mb)[:, :-1]
                aux_capture = engine.router_aux.capture() if engine.router_aux else contextlib.nullcontext()
                with contextlib.nullcontext() if backward else torch.no_grad(), aux_capture:
                    student = _logits(engine, mb)[:, :-1]
                # a model's padded vocabulary rows past the tokenizer are never targets: compare the shared part
                width = min(student.shape[-1], teacher.shape[-1])
                student, teacher = student[..., :width], teacher[..., :width]
                mask = mb[keys.LOSS_MASK][:, 1:].to(torch.float32)  # position t predicts token t + 1
                jsd = generalized_jsd(student, teacher, beta, temperature)
                if engine.router_aux is not None:  # a MoE student's load-balancing loss, as SFT and RL add it
                    aux = engine.router_aux.loss()
                    sums["router_aux"] += float(aux.detach()) / len(micro)
                if backward:
                    loss = (jsd * mask).sum() * self.dp_size / max(global_tokens, 1.0)
                    if engine.router_aux is not None:
                        loss = loss + engine.router_aux_loss_coef * aux.to(loss.device) / len(micro)
                    loss.backward()
                with torch.no_grad():
                    kl = generalized_jsd(student.detach(), teacher, 1.0, temperature)
                sums["jsd"] += float((jsd.detach() * mask).sum())
                sums["kl"] += float((kl * mask).sum())
                sums["tokens"] += float(mask.sum())
        finally:
            if backward:
                model.set_reshard_after_backward(True)
            reshard_all(model)
            reshard_all(self.teacher.model)
            model.train(was_training)
        tokens = max(sums["tokens"], 1.0)
        metrics = {"distill/jsd": sums["jsd"] / tokens, "distill/kl_to_teacher": sums["kl"] / tokens}
        if engine.router_aux is not None:
            metrics["actor/router_aux_loss"] = sums["router_aux"]
        return metrics

    def ping(self) -> dict[str, Any]:
        return {**super().ping(), "teacher": self.teacher is not None}
