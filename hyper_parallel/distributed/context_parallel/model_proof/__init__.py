"""CP preflight proof: the whole model computes the same thing under CP as without it.

Runs once, after the CP plan is applied and before the first step, on every rank together.
It is the general refusal of a token mixer that is not declared for CP and the safety net for
declared methods that are not the module's own computation (e.g. a dropped window or mask): no
name list is consulted, the model's numbers are compared. Modules: :mod:`.probe` (input),
:mod:`.state` (model state), :mod:`.checks` / :mod:`.prover` (the forwards), :mod:`.refusal`
(the error), :mod:`.prove` (the entry point). User-facing contract: docs/wrappers.md.

What it does (:func:`prove_cp_model`):

1. **Probe batch** (same on every rank, private generator): random token ids, ``B = 3`` rows —
   a full row, a right-padded row and a packed row of three documents (``seq_lens``; dropped
   when the batch contract refuses ``seq_lens``). ``S`` is a multiple of the batch policy's
   multiple (:func:`~..batch.policy_multiple`), at least 16 tokens per CP rank, longer than a
   config ``sliding_window`` (``+ max(16, w/4)``), capped by ``max_seq_len`` and the model's
   ``max_position_embeddings``.
2. **CP forward**: the batch is sharded exactly as the trainer shards it (the plan's
   ``batch_prepare_fn`` or :func:`~..batch.shard_batch_for_cp` with ``plan.batch_policy``) and
   the model runs ``model(input_ids, position_ids)`` inside ``cp_batch_context(meta)``.
   Forward pre-hooks/hooks on every decoder layer keep this rank's layer inputs and outputs.
3. **Reference forward**: every CP-wrapped module gets its original forward back (and its
   original config: the ``flex_hf*`` private config is undone) for the duration of one forward
   of the *same* model on the whole sequence, every document as its own right-padded row with
   ``attention_mask`` — i.e. what the model computes without CP. Hooks compare, layer by
   layer, this rank's chunk of the CP run with the matching tokens of the reference, on valid
   tokens only (padding is ignored, packed documents are independent by definition):
   the input of every layer, the *update* each layer adds (``out - in``: sensitive even when
   the residual stream dominates) and the final logits.
4. **Agreement**: per-checkpoint errors are all-gathered; the first checkpoint above
   tolerance (max over ranks) decides, identically on every rank.
5. **Attribution** (only on failure): one more reference and one more CP forward capture the
   inputs of the failing layer's direct children; each child, in call order, is re-run under
   CP on this rank's slice of the *reference* inputs, and its gathered output is compared
   with its reference output. The first child that differs given identical inputs is the
   token mixer named in the error (``model.layers.0.linear_attn (Qwen3NextGatedDeltaNet)``);
   if none does, the layer's own forward mixes tokens (named as the layer).

The refusal is a :class:`~...errors.CPConfigError` naming the layer, the module and its class,
whether a ``plan_overrides`` entry covers it, the reason, the max relative error and the fix.
Every phase is agreed with :func:`~...preflight.agree_or_raise` (world group): a failure on
one rank fails every rank, no rank is left in a collective.

Precision: the probe runs in float32 — a model whose (non-DTensor) parameters are bf16/fp16
is temporarily upcast (bit-exact round trip) — and compares with ``PROOF_TOLERANCE`` of the
compute dtype (a model under an FSDP2 bf16 policy compares with the bf16 tolerance). The
model is left as it was: no autograd (``no_grad``), ``eval()`` during the probe and every
module's train/eval flag restored, RNG states restored, hooks removed, CP forwards back.

Cost: one CP forward plus one full-sequence forward of the ``B x S`` probe on every rank (two
more of each only when it refuses), and the layer inputs/outputs of this rank's chunk
(``2 x layers x B x S/cp x hidden``) held until the reference pass.
"""
from __future__ import annotations

from .probe import probe_batch
from .prove import prove_cp_model
from .report import NO_INSTANCE_FORWARD, PROOF_TOLERANCE, ProofReport
from .state import cp_disabled

__all__ = ["prove_cp_model", "ProofReport", "PROOF_TOLERANCE", "cp_disabled", "probe_batch", "NO_INSTANCE_FORWARD"]
