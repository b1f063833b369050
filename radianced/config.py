"""The daemon's flags as one frozen, validated `Config`, built once at start-up.

`add_flags(parser)` declares every flag of SPEC §2 and §9 on an argparse
parser; `Config.from_args(ns)` (or `parse_config(argv)`) turns the parsed
namespace into a `Config`. Nothing else reads flags.

Two kinds of refusal, both a `ConfigError` whose message names the flag and
what would work:

- a bad value (negative, absurd, two flags that contradict each other) is
  refused when the `Config` is built, however it is built;
- a flag whose feature has not landed is parsed and then refused by
  `from_args` with "<flag>: not yet supported". The list is `NOT_YET_SUPPORTED`
  below; an issue that lands a feature deletes its line.

Values that need the model or the card (`--max-model-len 0` = the trained
context, the headroom implied by `--gpu-memory-mib`) are resolved by the
budget, not here.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence

import msgspec

from radianced.tmpfs import tmpfs_refusal

MiB = 1 << 20

DEFAULT_HEADROOM_MIB = 96
PLACEMENTS = ("auto", "expert_tiered", "resident")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_v4", "k6_v4")
SPECULATIVE_METHODS = ("auto", "ngram", "mtp")  # --speculative-method
TABLE_PLACEMENTS = ("vram", "ram")  # --embedding-placement, --vision-tower-placement
NGRAM_PLACEMENT = re.compile(r"^(vram|ram|disk)$|^(ram|disk)=.+$")
HOST_POOL_PLACEMENT = re.compile(r"^ram$|^ram=(\S.*)$")  # --host-pool-placement
KV_RESIDENT_MIN_TOKENS = 32768  # SPEC §6: a smaller ring is raised to this

# -- not yet landed ----------------------------------------------------------
# flag -> (Config field, the value that means "feature off"). The parser accepts
# these flags; `Config.from_args` refuses any other value. Delete a line when its
# feature lands.
NOT_YET_SUPPORTED: dict[str, tuple[str, object]] = {
    "--kv-resident": ("kv_resident", 0),
    "--ngram-placement": ("ngram_placement", None),
    "--vision-tower-placement": ("vision_tower_placement", None),
}


class ConfigError(ValueError):
    """A flag value the daemon cannot start with; the message names the flag and the fix."""


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """Every flag, validated. Field names are the flags' argparse dests."""

    # model and serving (SPEC §9)
    model: str | None = None  # None = the bundled SmolLM2-135M-Instruct
    served_model_name: str | None = None  # None = the model file's stem
    host: str = "127.0.0.1"
    port: int = 8000
    http_socket: str | None = None
    control_socket: str | None = None
    api_key: str | None = None
    api_key_file: str | None = None
    max_queue: int = 128
    drain_timeout: float = 30.0
    timeout_keep_alive: float = 5.0  # uvicorn's default
    timeout_headers: float = 10.0
    timeout_body: float = 60.0
    profile_dir: str | None = None
    # the card split (SPEC §2)
    gpu_headroom_mib: int | None = None  # None = DEFAULT_HEADROOM_MIB unless --gpu-memory-mib
    gpu_memory_mib: int | None = None
    card_mib: int | None = None  # plan a card of this size instead of the detected one
    max_model_len: int = 0  # 0 = the model's trained context
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    host_pool_mib: int = 0
    host_pool_placement: str = "ram"  # "ram": anonymous memory; "ram=DIR": a file in the tmpfs DIR, shared
    placement: str = "auto"
    deterministic: bool = False
    enforce_eager: bool = False  # no CUDA graphs: every step runs op by op
    sequential_steps: bool = False  # plan a step only after the previous one finished (no pipelining)
    max_step_seconds: float = 0.5  # a step's tokens are capped at what the measured prefill rate does in this
    itl_factor: float = 2.5  # a step with decodes takes at most this many decode steps' time (engine/pacing.py)
    weights_disk_tier: bool = False
    expert_slots: int | None = None  # None = as many as the budget allows
    kv_cache_dtype: str = "auto"
    kv_resident: int = 0
    embedding_placement: str | None = None  # None: the default (`embedding_table`)
    ngram_placement: str | None = None
    vision_tower_placement: str | None = None
    speculative: int = 0
    speculative_method: str = "auto"  # auto: mtp where the model has MTP layers, else ngram
    tp: int = 1

    def __post_init__(self) -> None:
        _check(self)

    # -- derived values ----------------------------------------------------

    @property
    def lending(self) -> bool:
        """KV and experts lend each other pages (`auto`/`expert_tiered` without `--deterministic`)."""
        return self.placement != "resident" and not self.deterministic

    @property
    def state_copies(self) -> int:
        """Recurrent-state copies per live sequence: one, plus one per draft token."""
        return self.speculative + 1

    def drafts_with_mtp(self, num_mtp_layers: int) -> bool:
        """Drafting runs the model's MTP head (it is loaded, its KV paged), for a model with
        `num_mtp_layers` MTP layers: `mtp`, or `auto` where the model has them (under `--tp N` every
        card holds its share of the head and runs its pass: engine/mtp_step.py)."""
        return self.speculative > 0 and num_mtp_layers > 0 and self.speculative_method in ("mtp", "auto")

    @property
    def decode_tokens(self) -> int:
        """Tokens of a step where every live sequence decodes (with its drafts)."""
        return self.max_num_seqs * (self.speculative + 1)

    @property
    def kv_resident_tokens(self) -> int:
        """The KV streaming ring in tokens (0 = off), raised to the minimum."""
        return max(self.kv_resident, KV_RESIDENT_MIN_TOKENS) if self.kv_resident else 0

    @property
    def host_pool_ram_dir(self) -> str | None:
        """The tmpfs folder of `--host-pool-placement ram=DIR` (`HostPool.create`'s ram_dir), else None."""
        m = HOST_POOL_PLACEMENT.match(self.host_pool_placement)
        return m[1] if m else None

    @property
    def embedding_table(self) -> str:
        """The `--embedding-placement` in effect: as given, else `ram` (SPEC §2): the table in host RAM and
        the step's rows read over the link. Measured on the H200 inside a decode graph (bf16, hidden 2048):
        5.2 us a step for 1 token and 4.9 for 8 against 5.1 and 5.1 from the card, 24 against 5 us for a
        256-token prefill; for Qwen3-30B-A3B that frees 593.5 MiB of the card for experts and KV."""
        return self.embedding_placement or "ram"

    def headroom_bytes(self, card_total_bytes: int) -> int:
        """Bytes of the card left untouched: `--gpu-headroom-mib`, or card − `--gpu-memory-mib`.

        May be negative when `--gpu-memory-mib` claims more than the card; the
        budget refuses that with the card's size in the message.
        """
        if self.gpu_memory_mib is not None:
            return card_total_bytes - self.gpu_memory_mib * MiB
        return self.headroom_mib * MiB

    @property
    def headroom_mib(self) -> int:
        """`--gpu-headroom-mib` as given or its default (meaningless with `--gpu-memory-mib`)."""
        return DEFAULT_HEADROOM_MIB if self.gpu_headroom_mib is None else self.gpu_headroom_mib

    # -- building ----------------------------------------------------------

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Config:
        """The config of a namespace parsed with `add_flags`; refuses flags not yet supported.

        Attributes of `ns` that are not Config fields (a CLI's own flags) are ignored.
        Raises ConfigError.
        """
        cfg = cls(**{f: getattr(ns, f) for f in cls.__struct_fields__ if hasattr(ns, f)})
        refuse_not_landed(cfg)
        return cfg


def refuse_not_landed(cfg: Config) -> None:
    """Raise ConfigError for the first flag set whose feature has not landed."""
    for flag, (field, off) in NOT_YET_SUPPORTED.items():
        if getattr(cfg, field) == off:
            continue
        shown = "unset" if off is None else off
        raise ConfigError(f"{flag}: not yet supported (leave it out; default {shown})")


# -- validation --------------------------------------------------------------

_LIMITS: dict[str, tuple[str, int, int]] = {
    # field: (flag, smallest, largest); the largest values are far past any real machine
    "port": ("--port", 0, 65535),
    "max_queue": ("--max-queue", 0, 1 << 20),
    "gpu_headroom_mib": ("--gpu-headroom-mib", 0, 1 << 24),
    "gpu_memory_mib": ("--gpu-memory-mib", 1, 1 << 24),
    "card_mib": ("--card-mib", 1, 1 << 24),
    "max_model_len": ("--max-model-len", 0, 1 << 24),
    "max_num_batched_tokens": ("--max-num-batched-tokens", 1, 1 << 20),
    "max_num_seqs": ("--max-num-seqs", 1, 1 << 16),
    "host_pool_mib": ("--host-pool-mib", 0, 1 << 26),
    "expert_slots": ("--expert-slots", 0, 1 << 24),
    "kv_resident": ("--kv-resident", 0, 1 << 24),
    "speculative": ("--speculative", 0, 16),
    "tp": ("--tp", 1, 64),
}

_CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "placement": ("--placement", PLACEMENTS),
    "kv_cache_dtype": ("--kv-cache-dtype", KV_CACHE_DTYPES),
    "speculative_method": ("--speculative-method", SPECULATIVE_METHODS),
}


def _check(c: Config) -> None:
    for field, (flag, lo, hi) in _LIMITS.items():
        v = getattr(c, field)
        if v is None and field in ("gpu_headroom_mib", "gpu_memory_mib", "card_mib", "expert_slots"):
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{flag} {v!r}: must be a whole number")
        if not lo <= v <= hi:
            raise ConfigError(f"{flag} {v}: must be between {lo} and {hi}")
    for field, (flag, choices) in _CHOICES.items():
        if getattr(c, field) not in choices:
            raise ConfigError(f"{flag} {getattr(c, field)!r}: choose one of {', '.join(choices)}")
    for flag, value in (("--embedding-placement", c.embedding_placement),
                        ("--vision-tower-placement", c.vision_tower_placement)):
        if value is not None and value not in TABLE_PLACEMENTS:
            raise ConfigError(f"{flag} {value!r}: choose one of {', '.join(TABLE_PLACEMENTS)}")
    _check_host_pool_placement(c)
    if c.ngram_placement is not None and not NGRAM_PLACEMENT.match(c.ngram_placement):
        raise ConfigError(f"--ngram-placement {c.ngram_placement!r}: choose vram, ram, disk, ram=DIR or disk=DIR")
    if not isinstance(c.drain_timeout, (int, float)) or not math.isfinite(c.drain_timeout) \
            or not 0 <= c.drain_timeout <= 86400:
        raise ConfigError(f"--drain-timeout {c.drain_timeout}: must be between 0 and 86400 seconds")
    for flag, value in (("--timeout-keep-alive", c.timeout_keep_alive), ("--timeout-headers", c.timeout_headers),
                        ("--timeout-body", c.timeout_body)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 86400:
            raise ConfigError(f"{flag} {value}: must be more than 0 and at most 86400 seconds")
    if not isinstance(c.max_step_seconds, (int, float)) or not math.isfinite(c.max_step_seconds) \
            or not 0 <= c.max_step_seconds <= 3600:
        raise ConfigError(f"--max-step-seconds {c.max_step_seconds}: must be between 0 (no cap) and 3600 seconds")
    if not isinstance(c.itl_factor, (int, float)) or not (c.itl_factor == 0 or 1 < c.itl_factor <= 1000):
        raise ConfigError(f"--itl-factor {c.itl_factor}: must be 0 (no cap) or above 1 (at most 1000)")
    if c.api_key is not None and c.api_key_file is not None:
        raise ConfigError("--api-key and --api-key-file both give the API key: keep --api-key-file")
    if c.gpu_headroom_mib is not None and c.gpu_memory_mib is not None:
        raise ConfigError("--gpu-headroom-mib and --gpu-memory-mib are mutually exclusive: give one")
    if c.max_num_batched_tokens < c.decode_tokens:
        what = "one token" if c.speculative == 0 else f"{c.speculative + 1} tokens (--speculative {c.speculative})"
        raise ConfigError(f"--max-num-batched-tokens {c.max_num_batched_tokens}: a step must decode {what} "
                          f"for each of --max-num-seqs {c.max_num_seqs}; give at least {c.decode_tokens}")
    if c.placement == "resident" and c.weights_disk_tier:
        raise ConfigError("--placement resident keeps every expert on the card; drop --weights-disk-tier "
                          "or use --placement auto")
    if c.placement == "resident" and c.expert_slots is not None:
        raise ConfigError("--placement resident gives every expert a slot; drop --expert-slots "
                          "or use --placement auto")
    for flag, value in (("--api-key", c.api_key), ("--api-key-file", c.api_key_file),
                        ("--profile-dir", c.profile_dir), ("--served-model-name", c.served_model_name),
                        ("--model", c.model), ("--http-socket", c.http_socket),
                        ("--control-socket", c.control_socket)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag}: empty; give a value or leave the flag out")
    if not c.host.strip():
        raise ConfigError("--host: empty; give an address such as 127.0.0.1")


def _check_host_pool_placement(c: Config) -> None:
    flag = f"--host-pool-placement {c.host_pool_placement!r}"
    if not HOST_POOL_PLACEMENT.match(c.host_pool_placement):
        raise ConfigError(f"{flag}: choose ram (the daemon's own memory) or ram=DIR (a file in the tmpfs DIR, "
                          f"shared by daemons on this host)")
    if c.host_pool_ram_dir is None:
        return
    if c.placement == "resident":
        raise ConfigError(f"{flag}: --placement resident keeps every expert on the card, so there is no host "
                          f"pool to share; drop --host-pool-placement or use --placement auto")
    if c.host_pool_mib == 0:
        raise ConfigError(f"{flag}: the host pool is empty (--host-pool-mib 0); give --host-pool-mib N")


def check_host(cfg: Config) -> None:
    """The checks that need this host's file systems, for the daemon's start: the folder of
    `--host-pool-placement ram=DIR` exists and is a tmpfs. Raises ConfigError. (Not in
    `Config` itself: `radiancectl plan` may plan for another machine.)"""
    folder = cfg.host_pool_ram_dir
    why = tmpfs_refusal(folder) if folder is not None else None
    if why is not None:
        raise ConfigError(f"--host-pool-placement {why}")


# -- argparse ----------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Declare every Config flag on `parser` (dests are the Config field names)."""
    _serving_flags(parser.add_argument_group("model and serving"), Config())
    _split_flags(parser.add_argument_group("the card split (radiancectl plan prints it)"), Config())


def _serving_flags(g, d: Config) -> None:
    g.add_argument("--model", help="the .rad to serve (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", help="model name in the API (default: the model file's name)")
    g.add_argument("--host", default=d.host, help=f"HTTP address (default {d.host})")
    g.add_argument("--port", type=int, default=d.port, help=f"HTTP port (default {d.port})")
    g.add_argument("--http-socket", help="serve HTTP on this Unix socket")
    g.add_argument("--control-socket", help="control API Unix socket (owner-only permissions)")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the API (every local user can read "
                                     "a command line: prefer --api-key-file or $RADIANCED_API_KEY)")
    g.add_argument("--api-key-file", metavar="PATH", help="require the bearer key held in this file (mode 0600)")
    g.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests waiting beyond the free sequence slots before 429 (default {d.max_queue})")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help=f"seconds in-flight requests may finish after SIGTERM (default {d.drain_timeout:g})")
    g.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
                   help=f"seconds an idle keep-alive connection stays open (default {d.timeout_keep_alive:g})")
    g.add_argument("--timeout-headers", type=float, default=d.timeout_headers,
                   help=f"seconds a request's line and headers may take to arrive (default {d.timeout_headers:g})")
    g.add_argument("--timeout-body", type=float, default=d.timeout_body,
                   help=f"seconds a request's whole body may take to arrive (default {d.timeout_body:g})")
    g.add_argument("--profile-dir", metavar="DIR",
                   help="where `radiancectl profile --save --out` may write besides the model's own profile "
                        "(relative paths resolve here; default: only the model's profile)")


def _split_flags(g, d: Config) -> None:
    g.add_argument("--gpu-headroom-mib", type=int,
                   help=f"MiB of the card left untouched (default {DEFAULT_HEADROOM_MIB})")
    g.add_argument("--gpu-memory-mib", type=int,
                   help="MiB of the card to use: headroom = card - N (instead of --gpu-headroom-mib)")
    g.add_argument("--card-mib", type=int, help="plan for an empty card of this many MiB")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="worst-case context the KV pool is sized against (default 0: the trained context)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step; sizes the activation workspace "
                        f"(default {d.max_num_batched_tokens})")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"live sequences at once (default {d.max_num_seqs})")
    g.add_argument("--host-pool-mib", type=int, default=d.host_pool_mib,
                   help="pinned host RAM for experts (default 0)")
    g.add_argument("--host-pool-placement", default=d.host_pool_placement, metavar="ram|ram=DIR",
                   help="host pool backing: ram (the daemon's own memory, default) or ram=DIR (a file in the "
                        "tmpfs DIR, e.g. /dev/shm/radianced: daemons on this host serving one model share one copy)")
    g.add_argument("--placement", choices=PLACEMENTS, default=d.placement,
                   help="auto/expert_tiered: experts and KV lend each other pages; resident: all on the card")
    g.add_argument("--deterministic", action="store_true", help="experts first, fixed split, no lending")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step op by op (slower; for debugging and measuring)")
    g.add_argument("--max-step-seconds", type=float, default=d.max_step_seconds,
                   help="cap a step's tokens at what the measured prefill rate computes in this time, so a new "
                        f"request or a cancel waits about that long on a slow device (0: the "
                        f"--max-num-batched-tokens budget alone; default {d.max_step_seconds:g})")
    g.add_argument("--itl-factor", type=float, default=d.itl_factor,
                   help="while sequences decode, a step that also prefills takes at most this many decode steps' "
                        "time, measured, so running streams keep their inter-token latency while new prompts "
                        f"prefill in chunks (0: the token budget alone; default {d.itl_factor:g})")
    g.add_argument("--sequential-steps", action="store_true",
                   help="plan each step after the previous one finished, instead of while it runs "
                        "(slower on a GPU; for debugging and measuring; always so on the CPU, where a step "
                        "is computed as it is launched)")
    g.add_argument("--weights-disk-tier", action="store_true",
                   help="experts that fit neither card nor host pool stay in the model file")
    g.add_argument("--expert-slots", type=int, help="cap on VRAM expert slots (default: what the budget allows)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV cache element type (default auto: the model's dtype; fp8 halves a bf16 "
                        "context's bytes, fp8_v4 and k6_v4 go further (int4 V, int6 K) at more loss and "
                        "attention time; "
                        "`radiancectl quality --kv-cache-dtype` measures what each costs in quality)")
    g.add_argument("--kv-resident", type=int, default=d.kv_resident,
                   help="KV streaming ring in tokens (block-sparse attention models)")
    g.add_argument("--embedding-placement", choices=TABLE_PLACEMENTS, default=d.embedding_placement,
                   help="token embeddings on the card or pinned in host RAM, read over the link in each step "
                        "(default: vram on a GPU, where ram is not yet measured; ram on the CPU backend)")
    g.add_argument("--ngram-placement", help="n-gram table: vram, ram, disk, ram=DIR or disk=DIR")
    g.add_argument("--vision-tower-placement", choices=TABLE_PLACEMENTS, help="vision encoder placement")
    g.add_argument("--speculative", type=int, default=d.speculative,
                   help="draft up to N tokens per step and verify them in the batch (default 0: off)")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=d.speculative_method,
                   help="ngram: prompt lookup over the sequence's own tokens; mtp: the model's MTP head; "
                        "auto (default): mtp where the model has one, else ngram")
    g.add_argument("--tp", type=int, default=d.tp,
                   help="split the model over N cards, one process each (radiancectl plan prints each card's split; serving: the CPU only for now, N gloo processes)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit(2)
        raise ConfigError(message)


def parse_config(argv: Sequence[str]) -> Config:
    """Parse `argv` (flags only, no program name) into a Config; raises ConfigError."""
    parser = _Parser(prog="radianced", add_help=False)
    add_flags(parser)
    return Config.from_args(parser.parse_args(list(argv)))
