"""What a router computes at inference (eval mode, dropless), in the terms Hugging Face's MoE
classes are configured by, and back to this toolkit's MoE config. One place reads the routing
fields of `MoEConfig`; model/moe/scoring.py says which Hugging Face router each option equals.

Our routers: DeepSpeed's gating (no --moe-router-* option) is a softmax over the experts, the
top-1 gate kept as it is, top-k >= 2 gates divided by their sum. Megatron-Core's routing: softmax
over the k best logits (normalised), or with --moe-router-pre-softmax the k best probabilities as
they are; sigmoid scores chosen with the expert bias and divided by their sum when k > 1 (unless
--disable-moe-router-norm-topk-prob); then the scaling factor; groups scored by their best
topk / group_topk experts.
"""

from dataclasses import dataclass

from megatron.model.moe import MoEConfig


@dataclass(frozen=True)
class Routing:
    topk: int
    score: str = "softmax"  # or "sigmoid": how each expert is scored from its logit
    normalized: bool = True  # the k gates divided by their sum (Hugging Face's norm_topk_prob)
    scaling: float = 1.0  # then multiplied by this (routed_scaling_factor)
    expert_bias: bool = False  # a per-expert bias added to the scores for choosing only
    num_groups: int = 1  # group-limited routing: the experts in this many groups ...
    group_topk: int = 1  # ... a token chooses within this many of them

    @property
    def group_limited(self) -> bool:
        return self.group_topk < self.num_groups

    @property
    def group_rule_is_hugging_faces(self) -> bool:
        """Hugging Face (GLM-4-MoE, DeepSeek-V3) scores a group by its 2 best experts, we by its best
        topk / group_topk: the same groups when those agree or when every group may be used."""
        return not self.group_limited or self.topk == 2 * self.group_topk


def routing_of(moe: MoEConfig) -> Routing:
    """What `moe`'s router computes in eval mode without token dropping."""
    scaling = moe.router_topk_scaling_factor if moe.router_topk_scaling_factor is not None else 1.0
    groups = (moe.router_num_groups, moe.router_group_topk) if moe.router_group_topk is not None else (1, 1)
    if not moe.megatron_core_routing:  # DeepSpeed's gating
        return Routing(moe.topk, "softmax", normalized=moe.topk >= 2)
    if moe.score_function == "softmax":
        normalized = not moe.router_pre_softmax
    else:
        normalized = moe.topk > 1 and moe.router_norm_topk_prob
    return Routing(moe.topk, moe.score_function, normalized, scaling, moe.router_enable_expert_bias, *groups)


def dropless_moe(routing: Routing, aux_loss_coeff: float) -> MoEConfig:
    """Our dropless MoE config with the router of a Hugging Face one (`unsupported_routing` has said
    it has an equivalent); `routing_of` of it gives `routing` back."""
    if routing.score == "softmax":
        # Megatron-Core's softmax rather than DeepSpeed's gating: the same gates, and in training
        # no Gumbel-sampled second expert or random token selection, as these models were trained
        return MoEConfig(
            topk=routing.topk,
            drop_tokens=False,
            aux_loss_coeff=aux_loss_coeff,
            router_score_function=None if not routing.normalized else "softmax",
            router_pre_softmax=not routing.normalized,
        )
    return MoEConfig(
        topk=routing.topk,
        drop_tokens=False,
        aux_loss_coeff=aux_loss_coeff,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_norm_topk_prob=routing.normalized,
        router_topk_scaling_factor=routing.scaling if routing.scaling != 1.0 else None,
        router_num_groups=routing.num_groups if routing.group_limited else None,
        router_group_topk=routing.group_topk if routing.group_limited else None,
    )


def unsupported_routing(routing: Routing) -> str | None:
    """What of a Hugging Face router ours cannot compute, or None."""
    if routing.score == "softmax" and routing.topk == 1 and routing.normalized:
        return "top-1 routing with the gate renormalised to 1 (ours keeps the softmax probability)"
    if routing.score == "sigmoid" and routing.topk == 1 and routing.normalized:
        return "top-1 sigmoid routing with the gate renormalised to 1 (ours keeps the sigmoid score)"
    if routing.score == "softmax" and (routing.scaling != 1.0 or routing.expert_bias or routing.group_limited):
        return "softmax routing with a scaling factor, expert bias or expert groups"
    if not routing.group_rule_is_hugging_faces:
        return (
            f"group-limited routing choosing {routing.group_topk} of {routing.num_groups} groups for "
            f"{routing.topk} experts (groups are scored by their best 2 experts there but by their best "
            f"{routing.topk // routing.group_topk} here)"
        )
    return None
