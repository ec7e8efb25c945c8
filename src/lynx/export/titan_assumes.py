"""What a plan for torchtitan assumed about the model it runs on (`lynx export torchtitan` writes it into the
engine's layer table; `lynx.integrations.torchtitan.checks` compares it with the model at apply time and at
the first forward). No torch here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from lynx.errors import PlanFormatError

ACTIVATION_BYTES = 2
"""The family torchtitan-llama3 prices 16-bit activations (torchtitan's bf16 ``mixed_precision_param``)."""


@dataclass(frozen=True, slots=True)
class PlanAssumes:
    """The plan's side of every apply-time check."""

    tp: int
    sequence_parallel: bool
    pp: int
    dp_replicate: int
    dp_shard: int
    micro_batch_size: int
    seq_length: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    activation_bytes: int = ACTIVATION_BYTES

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> PlanAssumes:
        names = [f.name for f in fields(cls)]
        if not isinstance(raw, dict):
            raise PlanFormatError(f"{where}: no `assumes` (the model the plan was made for); export the plan again "
                                  "with this lynx")
        missing = [n for n in names if n not in raw and n != "activation_bytes"]
        if missing:
            raise PlanFormatError(f"{where}: `assumes` lacks {', '.join(missing)}")
        try:
            values: dict[str, Any] = {n: (bool(raw[n]) if n == "sequence_parallel" else int(raw[n]))
                                      for n in names if n in raw}
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise PlanFormatError(f"{where}: a malformed `assumes` ({e})") from None


def assumes_of(problem: Any, dp_replicate: int, dp_shard: int) -> PlanAssumes:
    """From a `lynx.problem.PlanProblem` and the FSDP degrees the export writes."""
    m, par = problem.model, problem.parallel
    sp = bool(par.sequence_parallel and par.tp > 1)
    # the layer input's bytes per element as the plan's graph prices them (2 for the family; a graph profiled
    # in fp32 says 4)
    tokens = par.micro_batch_size * par.seq_length / (par.tp if sp else 1)
    act = round(problem.graph.input_bytes / (tokens * m.hidden_size)) or ACTIVATION_BYTES
    return PlanAssumes(tp=par.tp, sequence_parallel=sp, pp=par.pp, activation_bytes=act,
                       dp_replicate=dp_replicate, dp_shard=dp_shard, micro_batch_size=par.micro_batch_size,
                       seq_length=par.seq_length, hidden_size=m.hidden_size,
                       num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                       ffn_hidden_size=m.ffn_hidden_size)


__all__ = ["ACTIVATION_BYTES", "PlanAssumes", "assumes_of"]
