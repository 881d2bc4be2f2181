"""optim=muon: torch.optim.Muon on the drafter's hidden matrices, AdamW on everything else.

Which parameters Muon takes: the weight of every nn.Linear whose both sides exceed 1, that is
the attention and MLP projections, `fc` (the projection of the target's features into the drafter:
a dense hidden-to-hidden map like any other), and in DFlash 2 the convolutions' kernel projections
and the selector's hidden projection (dense maps from the hidden state). AdamW keeps the norms'
gains, the DFlash 2 convolutions' base kernels (3-D: [2, taps, hidden]) and the selector's
codebooks: those are vocabulary tables read one row per token, embeddings in all but name, where an
orthogonalised update would move every row of a table whose step touched a few (speculators'
`split_named_params_for_muon` leaves them to AdamW too; Keller Jordan's Muon leaves embeddings and
heads out). The target's embedding and LM head are frozen and not the drafter's parameters at all.

The update is torch's (2.13 `torch.optim.Muon`): momentum as an EMA of the gradients (Nesterov by
default), 5 Newton-Schulz iterations in bf16, decoupled weight decay lr * muon_weight_decay, and
the lr scaled per matrix by `adjust_lr_fn`: "match_rms_adamw" (Moonshot's 0.2 * sqrt(max(rows,
cols)), so the AdamW lr carries over; speculators' default, issue #979's recipe) or "original".
Both parts follow the trainer's lr schedule at optim.lr, as speculators' muon_lr defaults to lr.

The trainer's step path stays as it is: the gradient multiplier (clip, loss rescale) scales the
Muon gradients too, and with working weights (working_weights.py) Muon updates the fp32 masters
from the widened bf16 gradients and writes the bf16 copies after. Muon reads `applies` on the
host (its update is not a device-skippable pass): one synchronisation per step more than AdamW's.
Data-parallel drafters step on the same all-reduced gradients, so they stay identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dflash_mp.training.streaming_adamw import StreamingAdamW
from dflash_mp.training.working_weights import WorkingWeights


def muon_split(drafter: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's), each in the module's parameter order; trainable ones only."""
    matrices = {
        id(module.weight)
        for module in drafter.modules()
        if isinstance(module, nn.Linear) and module.weight.dim() == 2 and min(module.weight.shape) > 1
    }
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    return [p for p in trainable if id(p) in matrices], [p for p in trainable if id(p) not in matrices]


class MuonAdamW:
    """Muon and StreamingAdamW stepped together, with StreamingAdamW's interface for the trainer:
    `param_groups` (both: the schedule sets every lr), `gradients`, `step(grad_multiplier,
    applies)`, `uncount_last_step`, `zero_grad`, and one state dict holding both."""

    def __init__(
        self,
        matrices: list[Tensor],
        others: list[Tensor],
        optim: Any,
        working: dict[int, Tensor] | None = None,
    ) -> None:
        """`optim`: the config's optim section; `working` maps id(master) to its working copy."""
        self.adamw = StreamingAdamW(
            others, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, working=working
        )
        self.muon = torch.optim.Muon(
            matrices,
            lr=optim.lr,
            weight_decay=optim.muon_weight_decay,
            momentum=optim.muon_momentum,
            nesterov=optim.muon_nesterov,
            ns_steps=optim.muon_ns_steps,
            adjust_lr_fn=optim.muon_adjust_lr,
        )
        self.working = working or {}

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def _muon_params(self) -> list[Tensor]:
        return [p for group in self.muon.param_groups for p in group["params"]]

    def gradients(self) -> list[Tensor]:
        """The gradients this step reads (a master's: its working copy's where it has none)."""
        muon = [g for g in map(self.adamw.gradient, self._muon_params()) if g is not None]
        return muon + self.adamw.gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)  # also the working copies'

    @torch.no_grad()
    def step(self, closure=None, grad_multiplier: Tensor | None = None, applies: Tensor | None = None):
        """AdamW (queued on the device as ever), then Muon on `grad_multiplier` x the gradients if
        `applies`, which Muon reads on the host."""
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.adamw.step(grad_multiplier=grad_multiplier, applies=applies)
        if applies is not None and not bool(applies):
            return None
        params = [p for p in self._muon_params() if self.adamw.gradient(p) is not None]
        if not params:
            return None
        for param in params:  # Muon reads the masters' own gradients, in fp32
            if param.grad is None:
                param.grad = self.adamw.gradient(param).float()
        if grad_multiplier is not None:
            torch._foreach_mul_([p.grad for p in params], grad_multiplier.to(params[0].grad.dtype))
        self.muon.step()
        for param in params:
            if id(param) in self.working:
                self.working[id(param)].copy_(param)
        return None

    def uncount_last_step(self) -> None:
        self.adamw.uncount_last_step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(
                "the checkpoint's optimizer state is not optim=muon's (its keys: "
                f"{sorted(state_dict)}): resume with the optim it was saved with (optim=adamw)"
            )
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def build_optimizer(
    optim: Any, drafter: nn.Module, working: WorkingWeights | None = None
) -> StreamingAdamW | MuonAdamW:
    """The optimizer `optim` (the config's section) names for `drafter`, over its masters where
    `working` gives its matmul weights working copies."""

    def updated(params: list[nn.Parameter]) -> list[Tensor]:
        return list(params) if working is None else working.optimizer_parameters(params)

    copies = None if working is None else working.working_of
    if optim.name == "adamw":
        params = updated(list(drafter.parameters()))
        return StreamingAdamW(
            params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, working=copies
        )
    if optim.name != "muon":
        raise ValueError(f"optim.name={optim.name!r}: must be 'adamw' or 'muon'")
    matrices, others = muon_split(drafter)
    return MuonAdamW(updated(matrices), updated(others), optim, copies)
