"""Issue 24's headline run: a card smaller than the model, at full depth; the plan's prediction against the daemon.

    python tools/bench_headline.py --out OUT [--quick] [--dir DIR] [--steps model,profile,cards] \
        [--cards-mib 24576,32768,49152] [--shape qwen3-next-80b-a3b] [--layers 48] [--quantize experts=int4]
        (the second model: --shape qwen3-30b-a3b --quantize experts=fp8; a new model removes the other's file)

The model is tools/make_synthetic.py's (real per-layer shapes, random weights, a Zipf 1.0 router), at every layer,
its experts compact (`--quantize experts=int4`: Qwen3-Next-80B-A3B in about 47 GiB, so it fits the H200 machine's
64 GiB disk where fp8 would not). Each card budget (`--gpu-memory-mib`: 24, 32 and 48 GiB, the cards people own)
keeps what fits and homes every expert in the pinned host pool. Steps, each kept in DIR/radianced-headline-NAME/
(the model, its expert profile, headline.json) so that one device call (10 minutes at most) can make the model
and later ones run a card or two while the machine stays warm; a card already measured is not run again (one
that failed is):

1. model: written once (a complete file is reused).
2. profile: the daemon at the largest card serves decode-like traffic (short prompts, long outputs, c = 8) and
   `radiancectl profile --save` writes the expert profile beside the model, as an operator makes one; every later
   start-up fills its slots in that order.
3. cards: for each budget, first the prediction `radiancectl plan` prints for those flags (tiers/predict.py: hit
   rate and overflow bytes a token at b1 and b8, tok/s at the link rate probed here as start-up probes it, bounded
   by the link alone and with the card's reads at the measured HBM copy rate added), then the daemon started with
   the same flags and `radiancectl bench run --workloads decode,prefill,sweep` against it: the decode row (c = 1)
   and the sweep's c = 8 row give the measured hit rate, overflow a token, tok/s and J/token, the prefill rows
   TTFT. The report sets predicted beside measured (the issue's target: within 10% each). A row's measured
   counts include its prompts' prefill (the daemon's counters do not split it out), which the decode
   prediction leaves out: short prompts and long outputs keep that small. Cards run largest first: where one
   hits every expert, its decode step (TPOT p50 at that batch) predicts every card's tok/s with the card's
   misses moved from HBM to the link (`Prediction.from_resident`: the chain's last link, overflow -> tok/s),
   set against the measured decode rate (batch / TPOT p50).

Every call writes OUT/headline.json (the state), OUT/headline.md (the table) and, once a card has rows,
OUT/headline-chain.png (tools/headline_plot.py: card -> slots -> hit rate -> overflow -> tok/s), and each card
run its bench report, plots and daemon log as OUT/headline-MIB-*. Without CUDA (`--quick`, the CPU)
the model is 2 layers of Qwen3-30B-A3B at width / 8 and the cards are the smallest budgets that start plus 10%,
25% and 50% of the experts' bytes: it proves the code runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import httpx  # noqa: E402
import torch  # noqa: E402

from radianced.bench.daemon_process import ChildDaemon, daemon_config  # noqa: E402
from radianced.budget import PlanError, plan  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from radianced.sizing import ModelFacts  # noqa: E402
from radianced.tiers.placement import routed_experts  # noqa: E402
from radianced.tiers.predict import (link_gbps_from_resident, predictions, resident_step,  # noqa: E402
                                     tok_s_from_resident)
from radianced.tiers.profile import Profile, ProfileError, profile_path  # noqa: E402
from radianced.tp_plan import detect_cards  # noqa: E402
from tools import gpu_bench  # noqa: E402
from tools.bench_tiers import host_pool_mib  # noqa: E402
from tools.headline_plot import chain_plot  # noqa: E402
from tools.make_synthetic import SHAPES, make_synthetic  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
WORKLOADS = "decode,prefill,sweep"


@dataclass(frozen=True)
class Mode:
    shape: str
    layers: int
    narrow: int
    vocab: int | None
    serving: tuple[str, ...]  # the daemon's flags besides the model, the card and the host pool
    bench: tuple[str, ...]  # `bench run`'s size flag
    profile_requests: int  # decode-like requests of the profiling traffic, 8 at a time
    profile_tokens: int  # output tokens each
    quick: bool  # the CPU dry run's sizes


# 16 x 128 tokens at c = 8: ~256 steps, ~1M routed assignments over 24,576 experts (the H200's first run took 32 x 128
# in 252 s with the daemon's start-up; half the traffic ranks the Zipf head alike and leaves time for a card)
FULL = Mode("qwen3-next-80b-a3b", 48, 1, None, ("--max-num-seqs", "8", "--max-model-len", "20480"), (), 16, 128,
            False)
QUICK = Mode("qwen3-30b-a3b", 2, 8, 2048, ("--max-num-seqs", "8", "--max-queue", "8", "--max-model-len", "512"),
             ("--quick",), 8, 16, True)
FULL_CARDS_MIB = (24576, 32768, 49152)
PROFILE_COPY = "headline-expert-profile.bin"  # the profile's copy in OUT


# -- the steps ---------------------------------------------------------------------------------


def step_model(state: dict, home: Path, mode: Mode, quantize: str, device: str, folder: Path) -> None:
    path = home / "model.rad"
    if "model" in state and path.exists():
        print(f"model: {path} (made before, {state['model']['bytes'] / GiB:.2f} GiB)", flush=True)
        return
    for other in folder.glob("radianced-headline-*/model.rad"):  # the device's disk holds one headline model
        if other != path and _quick(other.parent) == mode.quick:  # a dry run never removes a full run's model
            print(f"model: removing {other} ({other.stat().st_size / GiB:.2f} GiB) to make room", flush=True)
            other.unlink()
    t0 = time.perf_counter()
    make_synthetic(path, shape=mode.shape, layers=mode.layers, zipf=1.0, vocab=mode.vocab, narrow=mode.narrow,
                   device=device, quantize=quantize, progress=not mode.quick)
    with RadFile.open(path) as rad:
        facts = ModelFacts.from_header(rad.header)
        experts = len(routed_experts(rad.header))
        pool_mib = host_pool_mib(rad)  # every routed expert homed in the pinned host pool
    state["model"] = {"path": str(path), "shape": mode.shape, "layers": mode.layers, "narrow": mode.narrow,
                      "quantize": quantize, "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0,
                      "experts": experts, "extent_bytes": facts.expert_extent_bytes, "host_pool_mib": pool_mib}


def _quick(home: Path) -> bool | None:
    """Whether the headline run kept in `home` was a dry run (None: no state there)."""
    state = home / "headline.json"
    return json.loads(state.read_text()).get("quick") if state.exists() else None


def serving_flags(state: dict, mode: Mode, card_mib: int) -> list[str]:
    return ["--model", state["model"]["path"], "--gpu-memory-mib", str(card_mib),
            "--host-pool-mib", str(state["model"]["host_pool_mib"]), *mode.serving]


def step_profile(state: dict, home: Path, mode: Mode, cards: list[int], out: Path, given: Path | None = None) -> None:
    """The expert profile beside the model (a copy in OUT, for a later call's --profile-from): made before,
    `given` (an earlier call's, of the same model: its checksum is checked), or made now."""
    path = profile_path(home / "model.rad")
    if "profile" in state and path.exists():
        print(f"profile: {path} (made before)", flush=True)
        return
    if given is not None and _install_profile(given, home / "model.rad"):
        state["profile"] = {"path": str(path), "from": str(given), "said": f"from an earlier call ({given.name})"}
        return
    t0 = time.perf_counter()
    socket = Path(tempfile.mkdtemp(prefix="radiance-headline-")) / "control.sock"
    daemon = ChildDaemon.start(serving_flags(state, mode, max(cards)) + ["--control-socket", str(socket)])
    start_s = time.perf_counter() - t0
    try:
        asyncio.run(_decode_traffic(daemon.url, mode))
        traffic_s = time.perf_counter() - t0 - start_s
        saved = subprocess.run([sys.executable, "-m", "radianced.ctl", "profile", "--save", "--replace",
                                "--control-socket", str(socket)], capture_output=True, text=True, timeout=120)
    finally:
        daemon.stop()
        if daemon.log_path.exists():
            shutil.copy(daemon.log_path, out / "headline-profile-daemon.log")
    if saved.returncode:
        raise RuntimeError(f"radiancectl profile --save failed: {saved.stderr.strip() or saved.stdout.strip()}")
    shutil.copy(path, out / PROFILE_COPY)
    state["profile"] = {"path": str(path), "card_mib": max(cards), "requests": mode.profile_requests,
                        "tokens": mode.profile_tokens, "said": saved.stdout.strip(), "start_s": start_s,
                        "traffic_s": traffic_s, "seconds": time.perf_counter() - t0}


def _install_profile(given: Path, model: Path) -> bool:
    """Copy `given` beside `model` if it is that model's profile (the synthetic model is the same file on
    every machine: same shape, seed and device); False, and nothing left there, where it is not."""
    path = profile_path(model)
    if not given.is_file():
        print(f"profile: {given} is not a file; making one", flush=True)
        return False
    shutil.copy(given, path)
    try:
        with RadFile.open(model) as rad:
            Profile.load_for(rad)
    except Exception as e:  # noqa: BLE001 - whatever refused it, the model gets a profile of its own
        path.unlink()
        print(f"profile: {given} is not this model's ({e}); making one", flush=True)
        return False
    print(f"profile: {given} (an earlier call's, the same model)", flush=True)
    return True


async def _decode_traffic(url: str, mode: Mode) -> None:
    """Decode-like requests (a 16-token prompt, `profile_tokens` out, temperature 1 so that the tokens, and with
    them the routing, spread as the router was fitted for), 8 at a time."""
    gate = asyncio.Semaphore(8)

    async def one(http: httpx.AsyncClient, model: str, i: int) -> None:
        body = {"model": model, "prompt": list(range(100 + 16 * i, 116 + 16 * i)), "max_tokens": mode.profile_tokens,
                "temperature": 1.0, "seed": i, "ignore_eos": True}
        async with gate:
            (await http.post("/v1/completions", json=body)).raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as http:
        model = (await http.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        await asyncio.gather(*(one(http, model, i) for i in range(mode.profile_requests)))


def step_card(state: dict, mode: Mode, card_mib: int, out: Path, rates: dict) -> dict:
    """One card budget: the plan's prediction, then the daemon measured with the same flags."""
    flags = serving_flags(state, mode, card_mib)
    cfg = daemon_config(flags)
    with RadFile.open(state["model"]["path"]) as rad:
        receipt = plan(detect_cards(cfg)[0], ModelFacts.from_header(rad.header), cfg)
        preds = predictions(rad, receipt, Profile.load_for(rad))
    row = {"card_mib": card_mib, "flags": flags, "bench_flags": list(mode.bench), "expert_slots": receipt.expert_slots,
           "receipt": receipt.lines(),
           "predicted": [_predicted(pr, rates) for pr in preds]}
    bench_out = Path(tempfile.mkdtemp(prefix="radiance-headline-bench-"))
    t0 = time.perf_counter()
    daemon = ChildDaemon.start(flags)
    row["start_s"] = time.perf_counter() - t0
    try:
        run = subprocess.run([sys.executable, "-m", "radianced.ctl", "bench", "run", "--url", daemon.url,
                              "--workloads", WORKLOADS, *mode.bench, "--out", str(bench_out),
                              "--max-num-seqs", str(cfg.max_num_seqs), "--max-queue", str(cfg.max_queue)],
                             capture_output=True, text=True, timeout=3600)
    finally:
        daemon.stop()
        shutil.copy(daemon.log_path, out / f"headline-{card_mib}-daemon.log")
    for f in bench_out.iterdir():  # flat: a device run brings back $OUT's files, not its folders
        shutil.move(f, out / f"headline-{card_mib}-{f.name}")
    bench_out.rmdir()
    bench = out / f"headline-{card_mib}-bench.json"
    if not bench.exists():
        raise RuntimeError(f"bench run wrote nothing (exit {run.returncode}): {run.stderr[-2000:]}")
    row["bench_exit"] = run.returncode
    row["measured"] = measured(json.loads(bench.read_text()))
    return row


def _predicted(pr, rates: dict) -> dict:
    link, hbm = rates.get("pcie_gbps"), rates.get("hbm_gbps")
    return {"batch": pr.batch, "slots": pr.slots, "hit_rate": pr.hit_rate,
            "overflow_bytes_per_token": pr.overflow_bytes_per_token,
            "tok_s_link_bound": pr.ceiling(link) if link else None,
            "tok_s_serial": pr.serial(link, hbm) if link and hbm else None}


def measured(bench: dict) -> list[dict]:
    """The decode row (c = 1) and the sweep's c = 8 row: hit rate, overflow a token, tok/s, J/token; the
    prefill rows' TTFT beside them. The hit rate and the overflow a token are the decode steps' (the daemon's
    counters by step kind), as the plan predicts them: a row's prompt is prefilled in its window too, and a
    prompt's step routes to most experts (the 24 GiB card at 396d148: 82.2% over the decode row with its
    prefill, 70.3% over a 128-token prefill alone). The row's whole figures stay beside them (`*_with_prefill`)."""
    rows = {w["name"]: w for w in bench["workloads"]}
    out = []
    for batch, name in ((1, "decode"), (8, "sweep c=8")):
        w = rows.get(name)
        if w is None:
            continue
        s, d = w["summary"], w["server"]
        energy = w["energy"] if isinstance(w["energy"], dict) else None
        tokens, tpot = s["output_tokens"], s["tpot"]["p50"]
        out.append({"batch": batch, "row": name, "hit_rate": d["decode_hit_rate"],
                    "overflow_bytes_per_token": d["decode_overflow_per_token"],
                    "hit_rate_with_prefill": d["hit_rate"],
                    "overflow_bytes_per_token_with_prefill": d["overflow_bytes"] / tokens if tokens else None,
                    "tok_s": s["output_tok_s"], "tpot_p50_s": tpot, "decode_tok_s": batch / tpot if tpot else None,
                    "joules_per_token": energy and energy["joules_per_token"]})
    ttft = {n: rows[n]["summary"]["ttft"]["p50"] for n in rows if n.startswith("prefill")}
    return out + [{"ttft_p50_s": ttft}] if ttft else out


def from_resident(state: dict) -> None:
    """Each card's predicted rows gain `tok_s_from_resident`: the decode step (TPOT p50) of the largest card
    that hit every expert at that batch, with the card's predicted misses moved from HBM to the link; None
    until such a card is measured. `resident_card_mib` names the card it came from: 0 where the step was given
    (`--resident-step-ms`, state["given_steps"]: measured in an earlier call) and no card of this state hit
    every expert at that batch."""
    rates, cards = state.get("rates", {}), state.get("cards", {})
    steps = {int(b): (0, s) for b, s in state.get("given_steps", {}).items()}  # batch -> (card MiB, TPOT p50 s)
    for mib in sorted(cards, key=int):
        for r in cards[mib].get("measured", []):
            if r.get("hit_rate") == 1.0 and r.get("tpot_p50_s"):
                steps[r["batch"]] = (int(mib), r["tpot_p50_s"])
    for row in cards.values():
        for pr in row.get("predicted", []):
            mib, step = steps.get(pr["batch"], (None, None))
            ok = step is not None and rates.get("pcie_gbps") and rates.get("hbm_gbps")
            pr["resident_card_mib"] = mib if ok else None  # 0: a given step
            pr["tok_s_from_resident"] = tok_s_from_resident(
                pr["batch"], pr["overflow_bytes_per_token"], step, rates["pcie_gbps"], rates["hbm_gbps"]) \
                if ok else None
        for got in row.get("measured", []):  # the link rate the measured step's own misses imply (the chain's gap)
            step = steps.get(got.get("batch"), (None, None))[1]
            ok = step is not None and rates.get("hbm_gbps") and got.get("tpot_p50_s") and \
                got.get("overflow_bytes_per_token") is not None
            got["miss_link_gbps"] = link_gbps_from_resident(
                got["batch"], got["overflow_bytes_per_token"], step, got["tpot_p50_s"], rates["hbm_gbps"]) \
                if ok else None


# -- the cards of a dry run ----------------------------------------------------------------------


def quick_cards(state: dict, mode: Mode) -> list[int]:
    """The smallest budget that starts, plus 10%, 25% and 50% of the experts' bytes (MiB)."""
    def starts(mib: int) -> bool:
        cfg = daemon_config(serving_flags(state, mode, mib))
        try:
            with RadFile.open(state["model"]["path"]) as rad:
                plan(detect_cards(cfg)[0], ModelFacts.from_header(rad.header), cfg)
            return True
        except PlanError:
            return False

    lo, hi = 1, 4096  # the dry run's model needs well under 4 GiB (and a budget past the card's own fails too)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if starts(mid) else (mid + 1, hi)
    experts_mib = state["model"]["experts"] * state["model"]["extent_bytes"] / MiB
    return [lo + -(-int(f * experts_mib * 100) // 100) for f in (0.10, 0.25, 0.50)]


# -- the report --------------------------------------------------------------------------------


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ratio(got, want) -> str:
    return "-" if got is None or not want else f"{got / want:.2f}"


def _link(gbps, probed) -> str:
    return "-" if gbps is None else f"{gbps:.1f}" + (f" ({gbps / probed:.0%})" if probed else "")


def _cells(mib: str, row: dict, link: float | None) -> list[str]:
    """A card's table rows: one per predicted batch, beside the measured row of that batch; `link` the probed
    PCIe GB/s."""
    meas = {r["batch"]: r for r in row["measured"] if "batch" in r}
    ttft = next((r["ttft_p50_s"] for r in row["measured"] if "ttft_p50_s" in r), {})
    out = []
    for pr in row["predicted"]:
        got = meas.get(pr["batch"], {})
        over = " / ".join("-" if v is None else f"{v / MiB:.2f}"
                          for v in (pr["overflow_bytes_per_token"], got.get("overflow_bytes_per_token")))
        pred = " / ".join(_tok(v) for v in (pr["tok_s_link_bound"], pr["tok_s_serial"], pr.get("tok_s_from_resident")))
        decode = got.get("decode_tok_s")
        joules = got.get("joules_per_token")
        first = ", ".join(f"{k}: {1e3 * v:.0f} ms" for k, v in ttft.items()) if pr["batch"] == 1 else ""
        out.append(f"| {_card(mib)} | {pr['batch']} | {pr['slots']} | {_pct(pr['hit_rate'])} / "
                   f"{_pct(got.get('hit_rate'))} | {over} | {pred} | {_tok(decode)} / {_tok(got.get('tok_s'))} | "
                   f"{_ratio(decode, pr.get('tok_s_from_resident'))} | {_ratio(decode, pr['tok_s_serial'])} | "
                   f"{_link(got.get('miss_link_gbps'), link)} | "
                   f"{'-' if joules is None else f'{joules:.3f}'} | {first} |")
    return out


def render(state: dict) -> str:
    m, rates, prof = state.get("model", {}), state.get("rates", {}), state.get("profile", {})
    took = f" (daemon ready in {prof['start_s']:.0f} s, traffic {prof['traffic_s']:.0f} s)" if "start_s" in prof else ""
    lines = [f"## headline: {m.get('shape')} at {m.get('layers')} layers ({m.get('quantize')}, "
             f"{m.get('bytes', 0) / GiB:.2f} GiB), {state.get('device')}, commit {state.get('commit')}"
             + (" (**CPU dry run: the numbers describe nothing**)" if state.get("quick") else ""), "",
             f"PCIe {_f(rates.get('pcie_gbps'))} GB/s (probed as start-up probes it), HBM copy "
             f"{_f(rates.get('hbm_gbps'))} GB/s; profile: {prof.get('said', '-')}{took}", "",
             "| card | b | slots | hit rate pred / meas | overflow MiB a token pred / meas | tok/s pred link bound / "
             "serial / from the resident step | tok/s meas decode / over the run | decode / from resident | "
             "decode / serial | misses' GB/s (of the link) | J/token | TTFT p50 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mib, row in sorted(state.get("cards", {}).items(), key=lambda kv: int(kv[0])):
        lines += [f"| {_card(mib)} | | | | | | | | | | | {row['error'][:300]} |"] if "error" in row \
            else _cells(mib, row, rates.get("pcie_gbps"))
    resident = {pr["resident_card_mib"] for row in state.get("cards", {}).values()
                for pr in row.get("predicted", []) if pr.get("resident_card_mib") is not None}
    given = ", ".join(f"{b}={1e3 * s:g}" for b, s in state.get("given_steps", {}).items())
    named = [_card(m) if m else f"measured in an earlier call: --resident-step-ms {given}" for m in sorted(resident)]
    lines += ["", "Decode is batch / TPOT p50 (\"over the run\" counts the prefill too); \"from the resident step\" "
              f"is the decode step of the card that hit every expert ({'; '.join(named)}) "
              "with each card's predicted misses moved from HBM to the link; \"misses' GB/s\" is the rate at which "
              "a measured step's own misses crossed, if the rest of it was that all-hit step."] if resident else []
    quick = [_card(mib) for mib, row in sorted(state.get("cards", {}).items(), key=lambda kv: int(kv[0]))
             if "--quick" in row.get("bench_flags", ())]
    lines += ["", f"Measured with `bench run --quick` (its workloads sized down: 32 decode tokens, prefill 128 and "
              f"256 tokens): {', '.join(quick)}."] if quick and not state.get("quick") else []
    return "\n".join(lines) + "\n"


def _card(mib) -> str:
    return f"{int(mib) // 1024} GiB" if int(mib) % 1024 == 0 else f"{mib} MiB"


def _f(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _tok(v) -> str:
    return "-" if v is None else f"{v:,.1f}"


# -- run ----------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the CPU dry run's sizes (the default without CUDA)")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where the model and the state stay")
    ap.add_argument("--steps", default="model,profile,cards", help="which of model, profile, cards to run")
    ap.add_argument("--cards-mib", help="card budgets (--gpu-memory-mib), comma-separated (default: 24, 32 and 48 "
                                        "GiB; the dry run's: its smallest that starts plus 10/25/50%% of the experts)")
    ap.add_argument("--quantize", default="experts=int4", help="make_synthetic's --quantize")
    ap.add_argument("--shape", choices=sorted(SHAPES), help=f"make_synthetic's shape (default {FULL.shape}; the "
                    "second model: qwen3-30b-a3b with --quantize experts=fp8, ~30 GiB)")
    ap.add_argument("--layers", type=int, help=f"decoder layers (default {FULL.layers})")
    ap.add_argument("--again", action="store_true", help="run cards already measured again")
    ap.add_argument("--profile-from", type=Path,
                    help=f"an earlier call's expert profile of the same model (its OUT/{PROFILE_COPY}): installed "
                         "instead of profiling (~250 s on a fresh machine) where its checksum matches the model")
    ap.add_argument("--bench-quick", action="store_true",
                    help="`bench run --quick` on each card (its workloads sized down: a card that misses decodes far "
                         "slower than one that hits, and the full sizes do not fit a device call beside the profile)")
    ap.add_argument("--resident-step-ms", type=resident_step, metavar="B=MS", action="append", default=[],
                    help="a decode step of B sequences (TPOT p50, ms) measured in an earlier call on a card that hit "
                         "every expert: the cards' from-resident prediction where none of this call's hits every "
                         "expert at B (a device call may not fit the largest card beside a smaller one)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = QUICK if args.quick or device == "cpu" else FULL
    mode = dataclasses.replace(mode, shape=args.shape or mode.shape, layers=args.layers or mode.layers,
                               bench=("--quick",) if args.bench_quick else mode.bench)
    home = args.dir / f"radianced-headline-{mode.shape}-{mode.layers}l-{args.quantize.replace('=', '-')}"
    home.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = home / "headline.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    state.update(quick=mode.quick, device=gpu_bench.section_env(args.out).get("device"),
                 commit=gpu_bench.commit()["commit"])
    steps = set(args.steps.split(","))
    state.setdefault("given_steps", {}).update({str(b): s for b, s in args.resident_step_ms})

    def save() -> None:
        from_resident(state)
        state_path.write_text(json.dumps(state, indent=1, default=str))
        shutil.copy(state_path, args.out / "headline.json")
        (args.out / "headline.md").write_text(render(state))
        chain_plot(state, args.out / "headline-chain.png")

    if "model" in steps or "model" not in state:
        step_model(state, home, mode, args.quantize, device, args.dir)
        save()
    cards = [int(c) for c in args.cards_mib.split(",")] if args.cards_mib else \
        quick_cards(state, mode) if mode.quick else list(FULL_CARDS_MIB)
    if "profile" in steps:
        step_profile(state, home, mode, cards, args.out, args.profile_from)
        save()
    if "cards" in steps:
        if "rates" not in state or args.again:
            state["rates"] = rates(device)
        for mib in sorted(cards, reverse=True):  # the largest first: where every expert hits, its step predicts
            if "error" not in state.setdefault("cards", {}).get(str(mib), {"error": ""}) and not args.again:
                continue  # measured; a card that failed runs again
            print(f"card {mib} MiB", flush=True)
            try:
                state["cards"][str(mib)] = step_card(state, mode, mib, args.out, state["rates"])
            except Exception as e:  # noqa: BLE001 - one card's failure is its row; the others still run
                state["cards"][str(mib)] = {"error": f"{type(e).__name__}: {e}"}
            save()
    save()
    print(render(state), flush=True)
    return 1 if any("error" in r for r in state.get("cards", {}).values()) else 0


def rates(device: str) -> dict:
    """The link as start-up probes it and the HBM copy rate (GB/s); neither on the CPU."""
    if device != "cuda":
        return {"pcie_gbps": None, "hbm_gbps": None}
    from radianced.tiers.link import probe_pcie

    hbm = gpu_bench.ceiling_copy(device, 2 * GiB)["bytes_per_s"]
    pcie = probe_pcie().gb_per_s
    gpu_bench._free_cuda()  # the daemons started next plan the card's memory: this process keeps none cached
    return {"pcie_gbps": pcie, "hbm_gbps": hbm / 1e9}


if __name__ == "__main__":
    sys.exit(main())
