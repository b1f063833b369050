"""The Markdown table of tools/bench_peer_offload.py's results: radianced beside transformers + accelerate
(and llama.cpp's llama-bench where it ran: its rows put it in the peer's column).

    python tools/peer_report.py DIR      # re-render DIR/peer_offload.md from DIR/peer_offload.json

Columns: the row, radianced's number, transformers + accelerate's, their ratio as a speed
(ours / theirs for tok/s, theirs / ours for a time: above 1, radianced is faster), a note.
Every number comes from the same run's JSON; a section that did not run says why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GiB, MiB = 1 << 30, 1 << 20


def render(res: dict) -> str:
    env, sizes = res.get("env", {}), res.get("sizes", {})
    lines = []
    if res.get("quick"):
        lines += [f"**Quick run on the CPU (width / {sizes.get('narrow')}, {sizes.get('layers')} layers, vocab "
                  f"{res.get('model', {}).get('vocab', '?')}): radianced with half the experts' slots, accelerate with "
                  "half the model in memory and the rest on disk; these numbers prove the code paths, nothing about "
                  "speed.**", ""]
    lines += [f"## radianced bench_peer_offload: {env.get('date_utc', '?')}, {env.get('device', '?')}, commit "
              f"{env.get('commit', '?')}, fingerprint {env.get('fingerprint', '?')}, torch {env.get('torch', '?')}, "
              f"transformers {_version(env.get('transformers'))}, accelerate {env.get('accelerate', '?')}", "",
              "| row | radianced | transformers + accelerate | ours / theirs (speed) | note |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows(res)]
    return "\n".join(lines) + "\n"


def rows(res: dict) -> list[tuple[str, str, str, str, str]]:
    m, ours, theirs = res.get("model", {}), res.get("ours", {}), res.get("theirs", {})
    sizes = res.get("sizes", {})
    out = []
    if m.get("status") == "ok":
        out.append(("model", f".rad {_gib(m['rad_bytes'])}", f"safetensors {_gib(m['hf_bytes'])}", "",
                    f"Qwen3-30B-A3B widths, {m['layers']} of {m['real_layers']} layers"
                    + (f", width / {m['narrow']}" if m["narrow"] != 1 else "") + f", bf16, random weights drawn on "
                    f"{m['random_on']} (router too: near-uniform routing); made {m['made_s']:.0f} s, saved "
                    f"{m['saved_s']:.0f} s, converted {m['converted_s']:.0f} s"))
    if ours.get("status") == "ok" or theirs.get("status") == "ok":
        out.append(_placement_row(sizes, ours, theirs))
        out.append(("load", _s(ours.get("build_s")), _s(theirs.get("load_s")),
                    _speed(theirs.get("load_s"), ours.get("build_s")),
                    "Engine.build (host pool filled, slots, graphs) / from_pretrained with device_map=auto"))
    for b in sizes.get("batches", ()):
        a, t = ours.get(f"b{b}") or {}, theirs.get(f"b{b}") or {}
        if not a and not t:
            continue
        out.append((f"TTFT b{b}, {a.get('prompt_tokens') or t.get('prompt_tokens')}-token prompts",
                    _s(a.get("ttft_s")), _s(t.get("ttft_s")), _speed(t.get("ttft_s"), a.get("ttft_s")),
                    "from adding the prompts to every sequence's first token on the host"))
        out.append((f"decode b{b}, greedy", _tps(a), _tps(t), _speed(a.get("tokens_per_s"), t.get("tokens_per_s")),
                    _decode_note(a, t)))
    for b, c in (res.get("compare") or {}).items():
        if isinstance(c, dict) and "equal" in c:
            firsts = [q["first_difference"] for q in c["sequences"]]
            out.append((f"greedy tokens {b}", f"{c['equal']} of {c['compared']} positions equal", "", "",
                        "first difference per sequence: " + ", ".join("none" if f is None else str(f) for f in firsts)
                        + " (bf16 on both; not expected equal throughout)"))
    out += _llama_rows(ours, res.get("llama_cpp") or {})
    if ours.get("peak_allocated_bytes") or theirs.get("peak_allocated_bytes"):
        out.append(("peak torch allocation on the card", _gib(ours.get("peak_allocated_bytes")),
                    _gib(theirs.get("peak_allocated_bytes")), "",
                    f"budget {sizes.get('card_mib', 0) / 1024:.0f} GiB (torch.cuda.max_memory_allocated, build/load "
                    "and decode; radianced's arena is one allocation)"))
    for name, sec in res.items():
        if isinstance(sec, dict) and sec.get("status") in ("error", "skipped", "failed"):
            out.append((f"section {name}", sec["status"], "", "", (sec.get("error") or sec.get("why") or "")[:300]))
    return out


def _placement_row(sizes: dict, ours: dict, theirs: dict) -> tuple:
    flags = ours.get("flags", {})
    budget = (f"--expert-slots {flags['expert_slots']}" if "expert_slots" in flags
              else f"--gpu-memory-mib {flags.get('gpu_memory_mib', sizes.get('card_mib'))}")
    mine = (f"{ours['expert_slots']} of {ours['experts']} expert slots" if ours.get("status") == "ok" else "-")
    p = theirs.get("placement") or {}
    where = ", ".join(f"{_gib(v)} on {k} ({p['layers'].get(k, 0)} layers)" for k, v in p.get("bytes", {}).items())
    mem = ", ".join(f"{k}: {_gib(v)}" for k, v in (theirs.get("max_memory") or {}).items())
    return ("placement at the budget", mine, where or "-", "",
            f"radianced {budget}, host pool {flags.get('host_pool_mib', '?')} MiB (every expert); "
            f"accelerate max_memory {{{mem}}}")


def _llama_rows(ours: dict, lc: dict) -> list[tuple]:
    """llama.cpp's rows: its value in the peer's column, the speed ratio against radianced's b1."""
    if lc.get("status") != "ok":
        return []
    b1 = ours.get("b1") or {}
    return [("llama.cpp placement", "", f"{_gib(lc['on_card_bytes'])} on the card; the routed experts of "
             f"{lc['n_cpu_moe']} of {lc['layers']} layers in host RAM", "",
             f"llama-bench --n-cpu-moe {lc['n_cpu_moe']} (the fewest that fit the budget with "
             f"{_gib(lc['margin_bytes'])} for KV and buffers); GGUF {_gib(lc['gguf_bytes'])} F16, written in "
             f"{lc['written_s']:.0f} s"),
            ("decode b1 against llama.cpp", _tps(b1), f"{lc['decode_tok_s']:,.1f} tok/s",
             _speed(b1.get("tokens_per_s"), lc["decode_tok_s"]),
             f"llama-bench -n {lc['rows'][-1].get('n_gen', '?')} after an empty context, 3 repetitions "
             f"(stdev {lc['decode_tok_s_stdev']:.1f}); radianced's b1 row above"),
            ("prompt, one sequence, llama.cpp", "", f"{lc['prompt_tok_s']:,.1f} tok/s", "",
             f"llama-bench -p {lc['rows'][0].get('n_prompt', '?')}")]


def _decode_note(a: dict, t: dict) -> str:
    parts = []
    if a:
        parts.append(f"radianced: {a['decode_steps']} Engine.step calls, hit {_pct(a.get('hit_rate'))}, overflow "
                     f"{_mib(a.get('overflow_bytes_per_token'))}/token, refills {_mib(a.get('refill_bytes'))}")
    if t:
        parts.append(f"transformers: {t['decode_steps']} forward calls")
    cut = [n for n, r in (("radianced", a), ("transformers", t)) if r.get("cut_at_deadline")]
    if cut:
        parts.append(f"cut at --time-limit: {', '.join(cut)}")
    return "; ".join(parts)


def _version(v) -> str:
    return str(v).split(" ")[0] if v else "?"


def _gib(v) -> str:
    return f"{v / GiB:.2f} GiB" if v else "-"


def _mib(v) -> str:
    return f"{v / MiB:.1f} MiB" if v is not None else "-"


def _s(v) -> str:
    return f"{v:.2f} s" if v is not None else "-"


def _pct(v) -> str:
    return f"{v:.1%}" if v is not None else "-"


def _tps(r: dict) -> str:
    v = r.get("tokens_per_s")
    return f"{v:,.1f} tok/s" if v else "-"


def _speed(num, den) -> str:
    return f"{num / den:.1f}x" if num and den else "-"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    text = render(json.loads((out / "peer_offload.json").read_text()))
    (out / "peer_offload.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
