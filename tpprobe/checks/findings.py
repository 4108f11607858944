"""Findings: one plain line each (class, place, ranks), with a sentence a person can act on."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

FAILURE, WARNING, INFO = "failure", "warning", "info"
SEVERITIES = (FAILURE, WARNING, INFO)          # worst first: every sort of findings by severity

# What each kind means and its usual cause, in one sentence.
EXPLAIN = {
    "partial-allreduce": "the tensor is one rank's partial sum: its all-reduce did not run (SGLang skips "
                         "the embedding reduce when attention input is scattered under DP attention; a "
                         "row-parallel layer built with reduce_results=False whose caller never reduces)",
    "allreduce-incomplete": "a reduce ran and returned the wrong value: a custom / one-shot all-reduce that read "
                            "its peers' buffers before their writes landed, a stale buffer, a broken driver or "
                            "link (vLLM custom all-reduce 'complete, fast, with wrong output'); the audit's own "
                            "input and output of that reduce show it",
    "subgroup-allreduce": "the all-reduce ran over a sub-group of the TP ranks (e.g. the attention-TP group "
                          "instead of the TP group): ranks agree inside each sub-group and differ across them",
    "rank-divergence": "one rank's values differ materially from the others (a stale or wrong weight shard, "
                       "a bad load, parameters that drifted across ranks)",
    "rounding-noise": "ranks differ by a few ULP only (reduction order, custom all-reduce, fused "
                      "all-reduce+RMSNorm); expected and harmless",
    "tp-sliced": "the capture holds this rank's hidden/tp slice instead of the full hidden state: it was "
                 "taken before the all-gather/all-reduce, or from a TP-sharded tensor",
    "capture-offset": "each slot holds the layer next to the one its id names: the +1 of the EAGLE-3 id "
                      "convention was applied where it should not be, or not applied where it should",
    "slot-mismatch": "the packed aux hidden state holds a different layer set or order than expected: the "
                     "draft model was trained on other slots (compare the serving ids with training's)",
    "aliased-capture": "a capture shares storage with a buffer that was overwritten later, so it holds a "
                       "later layer's value: clone() the hidden state when capturing",
    "transformed-capture": "the embedding slot holds a transformed value (after a norm or a dense layer), "
                           "not the raw embed_tokens output the draft was trained on",
    "non-finite": "NaN or Inf values on a rank (overflow in one shard, uninitialised memory)",
    "dtype-mismatch": "ranks or slots captured different dtypes (e.g. fp32 where bf16 was trained): "
                      "cast at capture time",
    "layout-mismatch": "the capture's layout is not what the draft expects (width, non-contiguous view, "
                       "shape differs across ranks)",
    "collective-mismatch": "ranks issued a different number, order or shape of collectives: a naive "
                           "gather would hang (draft tokens diverged across ranks, rank-dependent control flow)",
    "rank-timeout": "a rank stopped answering: it died or hung; the others stopped within the timeout",
    "missing-capture": "a requested layer id produced no capture (it maps past the last layer and is "
                       "silently dropped)",
    "reference-mismatch": "all ranks agree but differ from the unsharded tp=1 reference",
    "rank-error": "a rank raised an error during the probe",
    "internal-error": "tpprobe's own code failed on a rank (a bug in tpprobe, not in the model): that rank's "
                      "line says how to report it; the other ranks' records are checked as usual",
    "capture-mismatch": "ranks captured different points, shapes or dtypes: rank-dependent control flow "
                        "or a rank-specific capture path",
    "dims-mismatch": "the dims in the dump's meta contradict what the ranks hold (declared partial or sharded, "
                     "but every rank holds the same values): SGLang's comparator would unshard it wrongly",
    "partial-capture": "an aux slot holds each rank's partial sum plus the residual: the capture read the stream "
                       "before the owed all-reduce completed (SGLang defers each layer's reduce to the next "
                       "layer's boundary and on GPUs fuses it into add+RMSNorm; sglang PR #28343)",
    "capture-no-residual": "an aux slot holds a layer's output (hidden_states, the delta) without the residual "
                           "stream the draft was trained on (SpecForge#431, sglang#39286)",
    "id-contract": "the draft's configured layer ids and the target's capture rule select different tensors "
                   "(sglang#25454, vllm#46788)",
    "dp-gather-group": "under DP attention the aux states were gathered or reduced over the wrong group (the TP "
                       "group instead of the attention-TP group; sglang PR #20492)",
    "draft-unverified": "the aux slots were checked against the draft's config or the engine's own capture list, "
                        "not against what the draft was trained on: a config that is not the draft's training "
                        "(catalogue F32) would pass; say the training (TPPROBE_DRAFT_TRAINED=ids:A,B,C or "
                        "convention:output|before|vllm)",
    "capture-file": "a capture file is missing, truncated, corrupted or not in the manifest: re-run the "
                    "probe or copy the folder again",
}


@dataclass
class Finding:
    kind: str
    where: str
    ranks: list[int]
    severity: str = FAILURE
    detail: str = ""
    evidence: dict = field(default_factory=dict)
    consequences: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        ranks = "all ranks" if self.evidence.get("all_ranks") else (
            f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {self.ranks}")
        return f"{self.severity.upper()} {self.kind} at {self.where} ({ranks}): {self.detail}"

    def to_json(self) -> dict:
        d = asdict(self)
        d["line"] = self.line
        # a finding may say why more exactly than its kind's sentence (what its evidence points at)
        d["explain"] = self.evidence.get("explain") or EXPLAIN.get(self.kind, "")
        return d


def exit_code(findings: list) -> int:
    sev = [f["severity"] if isinstance(f, dict) else f.severity for f in findings]
    return 1 if FAILURE in sev else 0
