"""The join behind `eval.report`: read result files, sort their records into speed and quality, and
pair each quality run with the speed records of the same network and decoding.

Records (JSON lines, each remembered with its file and line):

- speed: a record with `status: ok` and a throughput, `decode_tok_s` (`decoders.compare`, one per
  model, context, batch) or `output_tok_s` (`decoders.serve_bench`, one per model and load:
  `arrivals` with `rate`, or `users`); optional fields read where present:
  `cost_per_1k_output_tokens`, `energy_j_per_output_token`, `peak_memory_bytes`, `tokens_per_pass`.
  Any other status (skipped, error, timeout, unfinished) is kept as "not measured".
- quality: a record with `task` and `metrics` (`eval.quality`), grouped into one run per
  (checkpoint, Mask-Predict T, decoder description), the newest record of each task kept.
- `kind: trained` records (`eval.ablation`) say which preset a checkpoint was trained from.

The join rule. Decode speed does not depend on weight values, so a quality run is joined with a speed
record when the speed record measured the same network running the same decoding:

- key `checkpoint`: the speed record's `model` is the quality run's checkpoint itself;
- key `preset`: the speed record ran random weights of the preset the checkpoint was trained from
  (named by a `trained` record, else by the checkpoint's folder name);

and, for either key, every field of the quality run's decoder description (family, config, dtype,
impl, Mask-Predict decoding, and any setting a later description adds) equals the speed record's,
except `model` (the key) and `cuda_graphs` (how the step is launched, not what it computes); the
device is equal; a speed record's quantisation or speculative setting is refused unless the quality
run names the same; and for Mask-Predict without blocks, the canvas (new tokens) of the speed record
equals the one the quality run sampled. A pair with the same key that fails any of these is refused,
with the fields that differ.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from decoders import UsageError
from eval.quality import GENPPL_TASK

# Fields of a decoder description that do not change what is measured.
NEUTRAL = ("model", "cuda_graphs")
# Settings a speed record may carry beyond the decoder description; refused unless equal.
SETTINGS = ("quantization", "speculative")


@dataclass
class Record:
    """One JSON line and where it came from."""

    data: dict
    file: str
    line: int

    @property
    def ref(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def anchor(self) -> str:
        return "rec-" + "".join(c if c.isalnum() else "-" for c in self.ref)


@dataclass
class QualityRun:
    """Every task of one checkpoint evaluated with one decoding."""

    checkpoint: str
    preset: str | None
    decoder: dict
    device: str | None
    tasks: dict = field(default_factory=dict)  # task -> Record (newest)

    @property
    def family(self) -> str:
        return self.decoder.get("family", "?")

    @property
    def iterations(self):
        return (self.decoder.get("decoding") or {}).get("iterations")

    @property
    def name(self) -> str:
        return Path(self.checkpoint).name or self.checkpoint

    @property
    def label(self) -> str:
        return self.name + settings_label(self.iterations, self.decoder)

    def metric(self, task: str, name: str):
        rec = self.tasks.get(task)
        return None if rec is None else rec.data["metrics"].get(f"{name},none")

    @property
    def records(self) -> list[Record]:
        return list(self.tasks.values())


@dataclass
class Join:
    """What the result files hold, sorted."""

    speed: list[Record]
    quality: list[QualityRun]
    pairs: list[tuple[QualityRun, Record, str]]  # (run, speed record, join key)
    refused: list[tuple[QualityRun, Record, list[str]]]  # (run, speed record, reasons)
    not_measured: list[Record]
    ignored: dict  # file -> number of records neither speed nor quality

    def speed_of(self, run: QualityRun) -> list[tuple[Record, str]]:
        return [(s, key) for q, s, key in self.pairs if q is run]


def settings_label(iterations, r: dict) -> str:
    """' T=4', ' quantization=int4' ...: what sets a run or point apart from others of its model."""
    out = f" T={iterations}" if iterations is not None else ""
    for k in SETTINGS:
        if r.get(k):
            value = r[k] if not isinstance(r[k], dict) else ",".join(f"{n}={v}" for n, v in r[k].items() if not isinstance(v, (dict, list)))
            out += f" {k}={value}"[:40]
    return out


def read_records(paths: list[str]) -> list[Record]:
    """Every JSON object in the files, in order; a missing file or a line that is not JSON is a
    usage error naming it. A record is named by its file's name, or by the path as given where two
    files share a name."""
    records = []
    names = [Path(path).name for path in paths]
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"no such result file: {path}")
        name = p.name if names.count(p.name) == 1 else str(path)
        with open(p) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path}:{n}: not a JSON line ({e.msg})") from None
                if not isinstance(data, dict):
                    raise UsageError(f"{path}:{n}: a JSON line must be an object")
                records.append(Record(data, name, n))
    return records


def throughput(r: dict):
    """The aggregate tokens/s a speed record reports, or None."""
    return r.get("decode_tok_s") or r.get("output_tok_s")


def is_speed(r: dict) -> bool:
    return "task" not in r and ("decode_tok_s" in r or "output_tok_s" in r or ("model" in r and "ctx" in r and "status" in r))


def is_quality(r: dict) -> bool:
    return "task" in r and isinstance(r.get("metrics"), dict) and "checkpoint" in r


def speed_identity(r: dict) -> tuple:
    """What makes two speed records the same point (the newest one is kept)."""
    settings = {k: r.get(k) for k in ("family", "dtype", "impl", "decoding", "device", "peer", *SETTINGS)}
    load = (r.get("ctx"), r.get("batch"), r.get("arrivals"), r.get("rate"), r.get("users"), json.dumps(r.get("workload"), sort_keys=True),
            r.get("new_tokens") if r.get("family") == "maskpredict" else None)
    return (r.get("model"), r.get("iterations"), json.dumps(settings, sort_keys=True), load)


def trained_presets(records: list[Record]) -> dict[str, str]:
    """checkpoint -> preset, from `kind: trained` records."""
    return {r.data["checkpoint"]: r.data["preset"] for r in records if r.data.get("kind") == "trained" and "checkpoint" in r.data}


def quality_runs(records: list[Record], presets: dict[str, str]) -> list[QualityRun]:
    runs = {}
    for rec in records:
        r = rec.data
        decoder = r.get("decoder") or {"family": r.get("family")}
        key = (r["checkpoint"], r.get("iterations"), json.dumps({k: v for k, v in decoder.items() if k not in NEUTRAL}, sort_keys=True), r.get("device"))
        if key not in runs:
            preset = presets.get(r["checkpoint"]) or Path(r["checkpoint"]).name or None
            runs[key] = QualityRun(r["checkpoint"], preset, decoder, r.get("device"))
        runs[key].tasks[r["task"]] = rec
    return list(runs.values())


def join_key(run: QualityRun, r: dict) -> str | None:
    """Which key would pair this run and speed record, before checking their settings."""
    if r.get("peer"):
        return None
    if r.get("model") == run.checkpoint:
        return "checkpoint"
    if run.preset is not None and r.get("model") == run.preset:
        return "preset"
    return None


def mismatches(run: QualityRun, r: dict) -> list[str]:
    """Why this speed record does not measure what the quality run measured (empty: it does)."""
    out = []
    for k, v in run.decoder.items():
        if k in NEUTRAL:
            continue
        if r.get(k) != v:
            if isinstance(v, dict) and isinstance(r.get(k), dict):
                fields = sorted(f for f in set(v) | set(r[k]) if v.get(f) != r[k].get(f))
                out += [f"{k}.{f}: {r[k].get(f)!r} (speed) vs {v.get(f)!r} (quality)" for f in fields]
            else:
                out.append(f"{k}: {r.get(k)!r} (speed) vs {v!r} (quality)")
    for k in SETTINGS:
        if k not in run.decoder and r.get(k):
            out.append(f"{k}: {r[k]!r} (speed) vs none (quality)")
    if run.device and r.get("device") and run.device != r["device"]:
        out.append(f"device: {r['device']!r} (speed) vs {run.device!r} (quality)")
    decoding = run.decoder.get("decoding") or {}
    if run.family == "maskpredict" and decoding.get("block_length") is None and GENPPL_TASK in run.tasks:
        canvas = run.metric(GENPPL_TASK, "new_tokens")
        if canvas is not None and r.get("new_tokens") is not None and r["new_tokens"] != canvas:
            out.append(f"canvas (new tokens, no blocks): {r['new_tokens']} (speed) vs {canvas:g} (quality)")
    return out


def join(records: list[Record]) -> Join:
    speed, quality, not_measured, ignored = {}, [], [], {}
    for rec in records:
        r = rec.data
        if is_quality(r):
            quality.append(rec)
        elif is_speed(r):
            if r.get("status", "ok") == "ok" and throughput(r):
                speed[speed_identity(r)] = rec
            else:
                not_measured.append(rec)
        elif r.get("kind") != "trained":
            ignored[rec.file] = ignored.get(rec.file, 0) + 1
    runs = quality_runs(quality, trained_presets(records))
    speed_list = sorted(speed.values(), key=lambda s: (s.file, s.line))
    pairs, refused = [], []
    for run in runs:
        for s in speed_list:
            key = join_key(run, s.data)
            if key is None:
                continue
            why = mismatches(run, s.data)
            if why:
                refused.append((run, s, why))
            else:
                pairs.append((run, s, key))
    paired_runs = {id(q) for q, _, _ in pairs}
    paired_speed = {id(s) for _, s, _ in pairs}
    # A refusal is worth showing when it left a side without any partner.
    refused = [(q, s, why) for q, s, why in refused if id(q) not in paired_runs or id(s) not in paired_speed]
    return Join(speed_list, runs, pairs, refused, not_measured, ignored)
