"""Real-dataset loaders (MLVU, EgoSchema, VisionArena), from local folders only; nothing is downloaded.

Each loader returns request records with ``arrival_s`` 0; ``workloads.build_workload`` samples them.
"""

from __future__ import annotations

import json
import pathlib
import warnings

__all__ = ["load_egoschema", "load_mlvu", "load_visionarena"]


def _require_dir(root, name: str, layout: str) -> pathlib.Path:
    root = pathlib.Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{name} folder {str(root)!r} not found; expected layout: {layout}")
    return root


def _record(request_id: str, prompt: str, media: list[dict]) -> dict:
    return {"request_id": request_id, "arrival_s": 0.0, "prompt": prompt, "media": media,
            "output_len": 64, "ignore_eos": True}


def _video(path: pathlib.Path, fps: float | None, max_frames: int | None) -> dict:
    return {"type": "video", "path": str(path.resolve()), "fps": fps, "max_frames": max_frames}


def _multiple_choice(question: str, options: list[str]) -> str:
    letters = "ABCDEFGHIJ"
    lines = [question.strip()] + [f"({letters[i]}) {o}" for i, o in enumerate(options)]
    return "\n".join(lines + ["Answer with the option's letter."])


def _keep_found(records: list[dict], missing: list[str], name: str, root: pathlib.Path) -> list[dict]:
    if missing:
        warnings.warn(f"{name}: skipped {len(missing)} questions whose media is missing, e.g. {missing[0]}")
    if not records:
        raise FileNotFoundError(f"{name}: no question with its media found under {root}")
    return records


MLVU_LAYOUT = ("ROOT/json/*.json (each a list of {video, question, candidates}), "
               "videos in ROOT/video/<json stem>/<video> or ROOT/video/<video>")


def load_mlvu(root, *, video_fps: float | None = 2.0, max_frames: int | None = None) -> list[dict]:
    """Multiple-choice questions of a local MLVU copy (the layout of its dev set).

    Layout: ``ROOT/json/*.json``, each a list of ``{"video": "x.mp4", "question": str,
    "candidates": [str, ...], ...}``; the video of ``json/1_plotQA.json`` is looked up in
    ``ROOT/video/1_plotQA/x.mp4`` and then ``ROOT/video/x.mp4``. Questions whose video is missing
    are skipped with a warning. Records come in file order with ``arrival_s`` 0.

    Raises FileNotFoundError naming this layout when ROOT or ``json/`` is missing, or when no
    video is found.
    """
    root = _require_dir(root, "MLVU", MLVU_LAYOUT)
    files = sorted((root / "json").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"MLVU: no json/*.json under {root}; expected layout: {MLVU_LAYOUT}")
    records, missing = [], []
    for f in files:
        for i, item in enumerate(json.loads(f.read_text())):
            candidates = [root / "video" / f.stem / item["video"], root / "video" / item["video"]]
            path = next((p for p in candidates if p.is_file()), None)
            if path is None:
                missing.append(str(candidates[0]))
                continue
            prompt = _multiple_choice(item["question"], list(item.get("candidates", [])))
            records.append(_record(f"mlvu-{f.stem}-{i}", prompt, [_video(path, video_fps, max_frames)]))
    return _keep_found(records, missing, "MLVU", root)


EGOSCHEMA_LAYOUT = ("ROOT/questions.json (a list of {q_uid, question, option 0..option 4}), "
                    "videos in ROOT/videos/<q_uid>.mp4")


def load_egoschema(root, *, video_fps: float | None = 2.0, max_frames: int | None = None) -> list[dict]:
    """Five-way questions of a local EgoSchema copy.

    Layout: ``ROOT/questions.json``, a list of ``{"q_uid": str, "question": str, "option 0": str,
    ..., "option 4": str}``, and ``ROOT/videos/<q_uid>.mp4``. Questions whose video is missing are
    skipped with a warning.

    Raises FileNotFoundError naming this layout when ROOT or questions.json is missing, or when no
    video is found.
    """
    root = _require_dir(root, "EgoSchema", EGOSCHEMA_LAYOUT)
    qfile = root / "questions.json"
    if not qfile.is_file():
        raise FileNotFoundError(f"EgoSchema: {qfile} not found; expected layout: {EGOSCHEMA_LAYOUT}")
    records, missing = [], []
    for item in json.loads(qfile.read_text()):
        path = root / "videos" / f"{item['q_uid']}.mp4"
        if not path.is_file():
            missing.append(str(path))
            continue
        options = [item[f"option {k}"] for k in range(5) if f"option {k}" in item]
        prompt = _multiple_choice(item["question"], options)
        records.append(_record(f"egoschema-{item['q_uid']}", prompt, [_video(path, video_fps, max_frames)]))
    return _keep_found(records, missing, "EgoSchema", root)


VISIONARENA_LAYOUT = ('ROOT/*.jsonl, one {"question": str, "images": [path, ...]} per line '
                      "(paths relative to the .jsonl's folder, or absolute)")


def load_visionarena(root) -> list[dict]:
    """Image questions of a local VisionArena-style export.

    Layout: ``ROOT/*.jsonl`` with one ``{"question": str, "images": ["img/1.png", ...]}`` per line
    (``"image": str`` is accepted for a single image); relative paths are resolved against the
    .jsonl file's folder. Questions with a missing image are skipped with a warning.

    Raises FileNotFoundError naming this layout when ROOT has no .jsonl file or no image is found.
    """
    root = _require_dir(root, "VisionArena", VISIONARENA_LAYOUT)
    files = sorted(root.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"VisionArena: no *.jsonl under {root}; expected layout: {VISIONARENA_LAYOUT}")
    records, missing = [], []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines()):
            if not line.strip():
                continue
            item = json.loads(line)
            names = item.get("images") or ([item["image"]] if item.get("image") else [])
            paths = [p if p.is_absolute() else f.parent / p for p in map(pathlib.Path, names)]
            lost = [p for p in paths if not p.is_file()]
            if lost or not paths:
                missing.append(str(lost[0]) if lost else f"{f}:{i + 1} (no image)")
                continue
            media = [{"type": "image", "path": str(p.resolve()), "fps": None, "max_frames": None} for p in paths]
            records.append(_record(f"visionarena-{f.stem}-{i}", item["question"], media))
    return _keep_found(records, missing, "VisionArena", root)
