"""`hf-tta run --direction a2t/t2a/v2t/...`: the audio/video grid end to end, with tiny CLAP / X-CLIP / CLIP
checkpoints saved to disk (loaded by `--model <folder>`) on a generated AudioSet-O/-D-style benchmark."""

from __future__ import annotations

import importlib.util
import json
import re
import string
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_tta import cli
from hf_tta.benchmarks import AVTask, GridRunner, RunSettings, av_dataset_configs, build_av_grid, direction_name
from support import word_level_clip_tokenizer
from tiny_av_models import (
    XCLIP_FRAMES,
    cav_mae_adapter,
    frame_stacks,
    tiny_cav_mae,
    tiny_clap,
    tiny_clip,
    tiny_xclip,
    waveforms,
)

pytest.importorskip("imagecorruptions", reason="the video corruptions need the `data` extra")

SR, N = 8000, 6
TEXTS = ["dog bark", "rain", "dog bark", "music", "speech", "engine"]
SMALL = ["--steps", "1", "--batch-size", "4", "--quiet", "--threads", "1", "--objectives", "tent"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Path:
    """6 clips (.npy waveforms and frame stacks) built into clean, video_noise_blur, video_diverse,
    audio_noise_weather and saved with save_av_benchmark."""
    from hf_tta.data.builders.audioset import AVClip, AVCorruptionSettings, build_av_benchmark, save_av_benchmark
    from hf_tta.data.corruptions.audio import NoiseBank

    root = tmp_path_factory.mktemp("av")
    audio, video = waveforms(N, 4000, SR), frame_stacks(N, XCLIP_FRAMES, 32)
    clips = []
    for i in range(N):
        np.save(root / f"a{i}.npy", audio[i])
        np.save(root / f"v{i}.npy", video[i])
        clips.append(AVClip(id=f"c{i}", audio=str(root / f"a{i}.npy"), video=str(root / f"v{i}.npy"), text=TEXTS[i], sampling_rate=SR))
    bank = NoiseBank({"wind": np.random.default_rng(0).standard_normal(1500).astype(np.float32)}, SR)
    settings = AVCorruptionSettings(seed=0, num_segments=2, video_pool=("contrast", "pixelate"))
    built = build_av_benchmark(
        clips, configs=["clean", "video_noise_blur", "video_diverse", "audio_noise_weather"], settings=settings,
        noise_bank=bank, sampling_rate=SR, cache_dir=str(root / "cache"),
    )
    save_av_benchmark(built, root / "bench")
    return root / "bench"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny CLAP, X-CLIP and CLIP checkpoints with their processors, as `save_pretrained` folders."""
    from transformers import (
        ClapFeatureExtractor,
        ClapProcessor,
        CLIPImageProcessor,
        CLIPProcessor,
        RobertaTokenizer,
        VideoMAEImageProcessor,
        XCLIPProcessor,
    )

    root = tmp_path_factory.mktemp("models")
    roberta = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>", "Ġ", *string.ascii_lowercase])}
    fe = ClapFeatureExtractor(feature_size=16, sampling_rate=SR, hop_length=128, max_length_s=1, fft_window_size=256,
                              truncation="rand_trunc", padding="repeatpad")
    frames = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    out = {}
    for name, model, processor in (
        ("clap", tiny_clap(), ClapProcessor(feature_extractor=fe, tokenizer=RobertaTokenizer(vocab=roberta, merges=[], model_max_length=32))),
        ("xclip", tiny_xclip(), XCLIPProcessor(image_processor=VideoMAEImageProcessor(**frames), tokenizer=word_level_clip_tokenizer(TEXTS))),
        ("clip", tiny_clip(), CLIPProcessor(image_processor=CLIPImageProcessor(**frames), tokenizer=word_level_clip_tokenizer(TEXTS))),
    ):
        model.save_pretrained(root / name)
        processor.save_pretrained(root / name)
        out[name] = root / name
    return out


def _rows(folder: Path) -> list[dict]:
    return json.loads((folder / "results.json").read_text())["rows"]


def test_clap_audio_to_text_and_text_to_audio(bench, models, tmp_path, capsys):
    out = tmp_path / "res"
    code = cli.main(["run", "--model", str(models["clap"]), "--dataset", str(bench), "--direction", "a2t,text->audio",
                     *SMALL, "--output-dir", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "**Audio→text retrieval (audio queries) under query shift, R@1 (%): 1 corruption stream; 1 seed (0)" in printed
    assert "| Method | Clean | N+W | Avg. | Won back |" in printed  # REST's column name
    assert "**Text→audio retrieval (text queries), R@1 (%): the clean stream; 1 seed (0)" in printed
    assert "| Method | Clean |\n" in printed and "- Clean: tent " in printed and "| • tent |" in printed
    rows = _rows(out)
    assert not [r for r in rows if "error" in r]
    by = {(r["direction"], r["shift"], r["objective"]): r for r in rows}
    assert sorted(by) == sorted([(d, s, o) for d, s in (("a2t", "noise_weather"), ("t2a", "clean")) for o in ("source", "tent")]
                                + [("a2t", "clean", "source")])  # the clean reference of the won-back share
    # audio queries: 6 clips against the 5 distinct texts; text queries: 5 texts against 6 clips (2 relevant to "dog bark")
    assert (by[("a2t", "noise_weather", "tent")]["num_queries"], by[("a2t", "noise_weather", "tent")]["gallery_size"]) == (6, 5)
    assert (by[("t2a", "clean", "tent")]["num_queries"], by[("t2a", "clean", "tent")]["gallery_size"]) == (5, 6)
    assert by[("a2t", "noise_weather", "tent")]["updates"] == 2  # 6 queries in batches of 4, one step each
    for r in rows:
        assert 0 <= r["R@1"] <= r["R@5"] <= r["R@10"] <= 100
    # the source row is exactly the model's retrieval of the stored benchmark (the AV author's loading recipe)
    from transformers import AutoModel, AutoProcessor

    from hf_tta.data.builders.audioset import load_av_retrieval
    from hf_tta.models import get_adapter

    processor = AutoProcessor.from_pretrained(models["clap"])
    adapter = get_adapter(AutoModel.from_pretrained(models["clap"]).eval())
    split = load_av_retrieval(bench, "audio_noise_weather", "audio->text", sampling_rate=processor.feature_extractor.sampling_rate)
    with torch.no_grad():
        q = torch.cat([adapter.embed("audio", b) for b in split.query_inputs(processor, batch_size=4)])
        g = torch.cat([adapter.embed("text", b) for b in split.gallery_inputs(processor, batch_size=4)])
    assert by[("a2t", "noise_weather", "source")]["R@1"] == pytest.approx(split.evaluate(q @ g.T)["R@1"], abs=1e-3)
    assert (out / "results.csv").read_text().splitlines()[1].startswith("a2t,clean,,source,0,")  # the clean reference first
    assert (out / "results.csv").read_text().splitlines()[2].startswith("a2t,noise_weather,,source,0,")
    assert (out / "r1_a2t.png").stat().st_size > 1000 and (out / "r1_t2a.png").exists() and (out / "diagnostics.png").exists()


def test_xclip_video_to_text_over_the_video_configs(bench, models, tmp_path, capsys):
    code = cli.main(["run", "--model", str(models["xclip"]), "--dataset", str(bench), "--direction", "video->text",
                     "--clean", "--no-plots", *SMALL, "--output-dir", str(tmp_path)])
    assert code == 0
    assert "| Method | Clean | N+B | Avg. | Diverse | Won back |" in capsys.readouterr().out
    rows = _rows(tmp_path)
    assert not [r for r in rows if "error" in r]
    assert {(r["direction"], r["shift"]) for r in rows} == {("v2t", s) for s in ("clean", "noise_blur", "diverse")}
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert meta["task"]["name"] == "av" and meta["notes"]["dataset_configs"][0] == "clean"
    # the corrupted stream differs from the clean one (the configs are really read)
    by = {(r["shift"], r["objective"]): r for r in rows}
    assert by[("clean", "source")]["uniformity_after"] != by[("noise_blur", "source")]["uniformity_after"]


def test_clip_embeds_videos_by_frame_pooling(bench, models, tmp_path):
    """CLIP's processor has no video path: the task feeds frames through its image processor (CLIPVideoAdapter)."""
    code = cli.main(["run", "--model", str(models["clip"]), "--dataset", str(bench), "--direction", "t2v,v2t",
                     "--corruptions", "video_diverse", "--no-plots", *SMALL, "--output-dir", str(tmp_path)])
    assert code == 0
    rows = _rows(tmp_path)
    assert not [r for r in rows if "error" in r]
    assert {(r["direction"], r["shift"]) for r in rows} == {("t2v", "clean"), ("v2t", "diverse"), ("v2t", "clean")}
    assert {r["gallery_size"] for r in rows if r["direction"] == "t2v"} == {N}


def test_directions_and_their_errors(bench, models, capsys):
    long_forms = ("v2a", "video->audio", "audio2video", "TEXT_TO_AUDIO", "image→text")
    assert [direction_name(d) for d in long_forms] == ["v2a", "v2a", "a2v", "t2a", "i2t"]
    def error_of(argv) -> str:  # a user mistake: exit status 2 and one line on stderr
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("hf-tta: error: ")
        return err

    err = error_of(["run", "--direction", "v2x"])
    assert "Unknown direction 'v2x'" in err and "a2v (audio->video)" in err and "t2v (text->video)" in err
    assert "mixes image-text and audio/video" in error_of(["run", "--direction", "i2t,a2t"])
    assert "need --model" in error_of(["run", "--direction", "a2t"])
    assert re.search(r"\['video_fog'\] are not configs.*audio_noise_weather", error_of(
        ["run", "--model", str(models["clap"]), "--dataset", str(bench), "--direction", "v2t", "--corruptions", "video_fog"]))
    assert re.search(r"\['audio_noise_weather'\] are not configs", error_of(  # audio queries' config, video queries
        ["run", "--model", str(models["clap"]), "--dataset", str(bench), "--direction", "v2t", "--corruptions", "audio_noise_weather"]))
    args = cli.build_parser().parse_args(["run", "--model", "m", "--dataset", str(bench), "--direction", "a2t,v2t", "--corruptions", "diverse"])
    jobs, _ = cli.resolve_grid(args)
    assert {(j.condition.direction, j.condition.shift) for j in jobs} == {("v2t", "diverse"), ("a2t", "clean"), ("v2t", "clean")}
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for name in ("a2t", "t2a", "v2t", "t2v", "v2a", "a2v", "video->audio", "DualEncoderAdapter"):
        assert name in help_text


def test_grid_picks_the_query_modality_configs(bench):
    configs = av_dataset_configs(bench)
    assert configs == ["clean", "video_noise_blur", "audio_noise_weather", "video_diverse"]
    jobs = build_av_grid(["tent"], ["v2a", "a2v", "t2v"], configs)
    conds = [(j.condition.direction, j.condition.shift) for j in jobs if j.objective == "source"]
    # the clean references (source only, for the won-back share) first, then each stream's source and objective rows
    assert conds == [("v2a", "clean"), ("a2v", "clean"), ("v2a", "noise_blur"), ("v2a", "diverse"), ("a2v", "noise_weather"), ("t2v", "clean")]
    assert [j.objective for j in jobs[2:4]] == ["source", "tent"]


class MelFrames:
    """CAV-MAE takes a ``(B, time, mel)`` fbank as ``input_values``: CLAP's log-mel features resized to (32, 16)."""

    def __init__(self):
        from transformers import ClapFeatureExtractor

        self.fe = ClapFeatureExtractor(feature_size=16, sampling_rate=SR, hop_length=128, max_length_s=1,
                                       fft_window_size=256, truncation="rand_trunc", padding="repeatpad")
        self.sampling_rate = SR

    def __call__(self, audio, sampling_rate, return_tensors="pt"):
        mel = self.fe(audio, sampling_rate=sampling_rate, return_tensors="pt")["input_features"]  # (B, 1, T, 16)
        return {"input_values": torch.nn.functional.interpolate(mel, size=(32, 16), mode="bilinear")[:, 0]}


def test_custom_dual_encoder_video_to_audio(bench):
    """The library path for CAV-MAE-style models (which --model cannot load): an adapter + a processor per modality."""
    from transformers import CLIPImageProcessor

    frames = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    task = AVTask(cav_mae_adapter(tiny_cav_mae()), str(bench), processor={"video": frames, "audio": MelFrames()}, limit=5)
    assert task.sampling_rate == SR
    rows = GridRunner(task, RunSettings(steps=1, batch_size=4, show_progress=False)).run_all(
        build_av_grid(["tcr"], ["v2a", "a2v"], av_dataset_configs(bench), selected=["video_noise_blur", "audio_noise_weather"]))
    assert not [r for r in rows if "error" in r]
    assert {(r["direction"], r["shift"], r["num_queries"], r["gallery_size"]) for r in rows} == {
        ("v2a", "noise_blur", 5, N), ("a2v", "noise_weather", 5, N), ("v2a", "clean", 5, N), ("a2v", "clean", 5, N)}
    tcr = next(r for r in rows if r["direction"] == "v2a" and r["objective"] == "tcr")
    assert tcr["updates"] == 2 and tcr["uniformity_after"] != tcr["uniformity_before"]  # the video tower adapted


def test_accelerate_recipe_takes_the_same_options(bench, models, tmp_path):
    from accelerate import PartialState

    spec = importlib.util.spec_from_file_location("accelerate_grid", Path(__file__).resolve().parents[1] / "recipes" / "accelerate_grid.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    try:
        rows = recipe.main(["--model", str(models["clap"]), "--dataset", str(bench), "--direction", "audio->text",
                            "--no-plots", *SMALL, "--output-dir", str(tmp_path)])
    finally:
        PartialState._reset_state()
    assert {(r["direction"], r["shift"], r["objective"]) for r in rows} == {("a2t", "noise_weather", o) for o in ("source", "tent")} | {
        ("a2t", "clean", "source")}
    assert cli.main(["run", "--model", str(models["clap"]), "--dataset", str(bench), "--direction", "a2t", "--no-plots",
                     *SMALL, "--output-dir", str(tmp_path / "cli")]) == 0
    cli_rows = {r["objective"]: r["R@1"] for r in _rows(tmp_path / "cli")}
    assert {r["objective"]: r["R@1"] for r in rows} == cli_rows  # same task construction, same table
