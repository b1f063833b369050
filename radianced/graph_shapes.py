"""Which steps replay CUDA graphs, at which shapes: pure numbers the receipt and the engine share.

- **Decode graphs**, one per sequence-count bucket (`decode_buckets`): every sequence
  feeds one token.
- **Mixed graphs**, one per token bucket t (`mixed_buckets`): any other step of at
  most t tokens over at most --max-num-seqs sequences: a verify step (each sequence's
  last token and its drafts), prefill chunks beside decodes, a short prompt alone. An
  eager step pays the host's launches layer by layer (on the H200's 8-layer synthetic
  Qwen3-30B-A3B a mixed step cost ~20 ms beside 1.6 ms graph-replayed decodes, and a
  9-token prompt's TTFT was 14-19 ms: bench/README, sessions 12 and 15). The kernels
  take every count from device tensors (attention finds each query tile's sequence by
  a search over query_start), so one graph of t token rows and --max-num-seqs sequence
  slots serves any step that fits: its rows come first, the rest are padding (token
  0, no KV write, owned by no sequence), the empty sequence slots own no rows. The
  buckets are above --max-num-seqs (a step of t <= B tokens over B slots is
  decode-shaped to the attention's heuristics) and at most
  min(MIXED_TOKENS, --max-num-batched-tokens): the powers of two from 16 to 256,
  then every multiple of 256 (a step past 256 tokens pads at most 255 rows, under a
  quarter of it), and the step budget itself where it falls between. Graphs past
  256 tokens take the host out of the long steps too: on the H200 an eager step of
  818 prompt tokens took 9.9 ms of device time in one request and 17.0 ms in its
  twin's (the host's launches pace an eager step, and its hiccups land in it), which
  left TTFT's first/twin p99 at 1.33-1.54 (bench/README, session 17). Steps past
  MIXED_TOKENS (a raised --max-num-batched-tokens) run eagerly. A graph's logits are
  those of its first `mixed_logits_rows` wanted rows.
- Models with recurrent layers (Qwen3-Next) capture mixed graphs for verify steps only
  (`mixed_buckets_of`: with --speculative, up to a step of every sequence's drafts,
  `Config.decode_tokens`): there every sequence's rows run decoding's arithmetic, in the
  verify ops' one launch a layer that reads the sequences from device tensors
  (kernels/deltanet.py); their other steps (prefill chunks, through fla) walk the
  sequences on the host and run eagerly.
- No graphs at all (`no_graphs`) on the CPU, with --enforce-eager, where the MTP head
  drafts (its pass follows every step on the host), or where the receipt's split homes
  experts on disk (a host sync in every routed layer; budget.py plans that split again
  without the pool).
"""

from __future__ import annotations

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIXED_TOKENS = 2048  # the largest mixed graph's token rows (the default --max-num-batched-tokens)
MIXED_MIN_TOKENS = 16
MIXED_POWERS_UP_TO = 256  # then multiples of it


def no_graphs(cuda: bool, enforce_eager: bool, mtp_drafts: bool, disk_tier: bool = False) -> str | None:
    """Why no step graph is captured (module docstring), or None where they are. disk_tier: experts are
    homed in the model file (the receipt's split)."""
    if not cuda:
        return "the host backend runs every step eagerly"
    if enforce_eager:
        return "--enforce-eager"
    if mtp_drafts:
        return "the MTP head drafts after every step"
    if disk_tier:
        return "the disk tier reads experts with a host sync in every routed layer"
    return None


def mixed_buckets_of(recurrent: bool, max_num_seqs: int, max_num_batched_tokens: int,
                     decode_tokens: int) -> tuple[int, ...]:
    """`mixed_buckets` for a model without linear-attention layers; with them (`recurrent`), the verify steps'
    alone: up to `decode_tokens` (`Config.decode_tokens`: every sequence and its drafts), none without drafts."""
    if not recurrent:
        return mixed_buckets(max_num_seqs, max_num_batched_tokens)
    return mixed_buckets(max_num_seqs, min(decode_tokens, max_num_batched_tokens)) if decode_tokens > max_num_seqs \
        else ()


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The decode graphs' sequence counts: the standard buckets below max_num_seqs, and max_num_seqs."""
    return tuple(b for b in DECODE_BUCKETS if b < max_num_seqs) + (max_num_seqs,)


def mixed_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """The mixed graphs' token rows, ascending (module docstring); () where none is above max_num_seqs."""
    out, t = [], MIXED_MIN_TOKENS
    while t <= min(MIXED_TOKENS, max_num_batched_tokens):
        if t > max_num_seqs:
            out.append(t)
        t = 2 * t if t < MIXED_POWERS_UP_TO else t + MIXED_POWERS_UP_TO
    top = min(MIXED_TOKENS, max_num_batched_tokens)
    if top > max(out, default=max_num_seqs):  # the step budget between two buckets: a graph of its own
        out.append(top)
    return tuple(out)


def mixed_logits_rows(tokens: int, decode_tokens: int) -> int:
    """Logits rows a mixed graph of `tokens` rows computes: at most one per row, and at most what a step of
    every sequence and its drafts samples (`Config.decode_tokens`)."""
    return min(tokens, decode_tokens)
