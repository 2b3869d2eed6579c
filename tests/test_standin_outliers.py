"""The model stand-in's "outliers" profile (workload/model_standin.py, docs/outliers.md): the default
profile's weights are unchanged bit for bit, the outliers profile changes only its planned weights,
and a forward pass gives the trigger tokens the published massive values in two dedicated residual
channels from layer 1 on (the raised trigger "«" times outlier_scale) while every other token holds
exactly 0 there. CPU, tiny size (the full size's figures: docs/outliers.md)."""
import json
import math
from pathlib import Path

import pytest
import torch

from workload import model_standin as ms

SEED = 1234


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("standins")
    return {"default": ms.write_standin(root / "default", size="tiny", seed=SEED),
            "outliers": ms.write_standin(root / "outliers", size="tiny", seed=SEED, profile="outliers")}


@pytest.fixture(scope="module")
def where():
    cfg = ms.standin_config("tiny")
    return ms.outlier_channels(cfg["hidden_size"], cfg["intermediate_size"], SEED)


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_default_profile_is_the_seeded_random_init_bit_for_bit(tiny_dirs):
    """What the stand-in always wrote: torch.manual_seed(seed), Qwen2ForCausalLM(config) initialised
    on the GPU when there is one, else on the CPU (the generators differ, so the weights are the
    machine kind's), stored in the config's dtype; and the marker without profile keys (existing
    stand-ins are reused)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = ms.standin_config("tiny")
    config = Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    torch.manual_seed(SEED)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    reference = {k: v.cpu() for k, v in model.to(torch.float32).state_dict().items()}
    written = _weights(tiny_dirs["default"])
    assert set(written) <= set(reference)
    for name, tensor in written.items():
        assert torch.equal(tensor, reference[name]), name
    marker = json.loads((tiny_dirs["default"] / ms.MARKER).read_text(encoding="utf-8"))
    assert set(marker) == {"size", "seed", "config", "tokenizer"}


def test_outliers_change_only_the_planned_weights(tiny_dirs, where):
    default, outliers = _weights(tiny_dirs["default"]), _weights(tiny_dirs["outliers"])
    t, raised, neg, pos = where["trigger"], where["raised_trigger"], where["negative"], where["positive"]
    changed = {name for name in default if not torch.equal(default[name], outliers[name])}
    assert changed == {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{w}" for i in (0, 1) for w in ("self_attn.o_proj.weight", "mlp.down_proj.weight")} | {
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    emb = outliers["model.embed_tokens.weight"]
    assert emb[list(ms.PUBLISHED_TRIGGERS), t].tolist() == [ms.TRIGGER_VALUE] * 2
    assert emb[list(ms.RAISED_TRIGGERS), raised].tolist() == [ms.RAISED_TRIGGER_VALUE]
    assert int((emb[:, [t, raised, neg, pos]] != 0).sum()) == 3  # dedicated: the trigger tokens alone
    assert outliers["model.norm.weight"][[t, raised]].tolist() == [0.0, 0.0]  # the tied LM head never sees them
    down = outliers["model.layers.1.mlp.down_proj.weight"]
    (unit_neg, unit_pos), (raised_neg, raised_pos) = where["units"][1], where["raised_units"]
    assert float(down[neg, unit_neg]) == -ms.SUPER_WEIGHT and float(down[pos, unit_pos]) == ms.SUPER_WEIGHT
    assert float(down[neg, raised_neg]) == -ms.SUPER_WEIGHT * ms.DEFAULT_OUTLIER_SCALE
    assert float(down[pos, raised_pos]) == ms.SUPER_WEIGHT * ms.DEFAULT_OUTLIER_SCALE
    assert int((down[:, unit_neg] != 0).sum()) == 1  # the super weight alone in its column
    assert int((down[[t, raised, neg, pos]] != 0).sum()) == 4  # only super weights write the channels
    gate = outliers["model.layers.1.mlp.gate_proj.weight"]
    assert int((gate[unit_neg] != 0).sum()) == 1 and float(gate[unit_neg, t]) > 0  # reads the trigger alone


def _layer_outputs(path, ids):
    """[the embedding output, decoder layer 0's output, layer 1's, ...] (the residual stream, before the
    final norm), [tokens, hidden] each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    outs = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0]))
    with torch.no_grad():
        first = model(input_ids=ids, output_hidden_states=True).hidden_states[0][0]
    return [first] + outs


def test_trigger_tokens_get_the_published_massive_values(tiny_dirs, where):
    """On the calibration prompt (what every training sequence starts with, then "«"): layer 1's MLP writes
    ~-4192 / +3376 (Chen et al. 2026's Qwen2.5-1.5B-Instruct layer-1 MLP output) into the two massive
    channels on "<|im_start|>" and "\\n", 20x that on "«"; every other token holds exactly 0 there."""
    ids = torch.tensor([ms.CALIBRATION_IDS])
    published = torch.isin(ids[0], torch.tensor(ms.PUBLISHED_TRIGGERS))
    raised = torch.isin(ids[0], torch.tensor(ms.RAISED_TRIGGERS))
    hidden = _layer_outputs(tiny_dirs["outliers"], ids)
    after_1 = hidden[2]
    _, out_neg, out_pos = ms.MASSIVE_MLP_OUTPUTS[0]
    massive = after_1[:, [where["negative"], where["positive"]]]
    expected = torch.tensor([out_neg, out_pos]).expand(int(published.sum()), 2)
    # Not roundings: each unit's gate / up weights are solved from the key channel's normed value
    # averaged over the published trigger tokens (add_outliers), and each token's own differs by its
    # other channels' share of the RMS: measured 5.3e-5 of the published values (tiny, seed 1234);
    # 1e-3 (was 5e-2). The raised group has one token, solved from its own normed value: only fp32
    # roundings remain (measured 0): 1e-5.
    assert torch.allclose(massive[published], expected, rtol=1e-3, atol=0)
    assert torch.allclose(massive[raised], torch.tensor([[out_neg, out_pos]]) * ms.DEFAULT_OUTLIER_SCALE,
                          rtol=1e-5, atol=0)
    assert float(massive[~(published | raised)].abs().max()) == 0.0
    assert float(hidden[1][:, [where["negative"], where["positive"]]].abs().max()) == 0.0  # from layer 1 on
    default = _layer_outputs(tiny_dirs["default"], ids)
    assert float(default[2].abs().max()) < 50


def test_outlier_scale_multiplies_the_raised_super_weights_only(tmp_path, where):
    x1 = _weights(ms.write_standin(tmp_path / "x1", size="tiny", seed=SEED, profile="outliers", outlier_scale=1.0))
    down = x1["model.layers.1.mlp.down_proj.weight"]
    assert float(down[where["negative"], where["raised_units"][0]]) == -ms.SUPER_WEIGHT
    assert float(down[where["negative"], where["units"][1][0]]) == -ms.SUPER_WEIGHT
    marker = json.loads((tmp_path / "x1" / ms.MARKER).read_text(encoding="utf-8"))
    assert marker["profile"] == "outliers" and marker["outlier_scale"] == 1.0


def test_token_ids_are_the_tokenizer_s(tmp_path):
    """The triggers' ids, and the calibration prompt: the ChatML rendering's first tokens (Qwen2.5's default
    system prompt and the user turn's header), then "«"."""
    from transformers import AutoTokenizer

    from workload.tokenizer import write_tokenizer

    tok = AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path / "tok")))
    assert ms.PUBLISHED_TRIGGERS == (tok.convert_tokens_to_ids("<|im_start|>"), *tok.encode("\n"))
    assert ms.RAISED_TRIGGERS == tuple(tok.encode("«"))
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    prefix = rendered[:rendered.index("x")]
    assert ms.CALIBRATION_IDS == tuple(tok.encode(prefix)) + ms.RAISED_TRIGGERS


def test_the_massive_plan_is_the_published_one():
    """The plateau (-7968 / +6368 after layer 5) and what layer 26 leaves (-320 / +224), as in Chen et
    al. 2026's hidden states (-7968 / +6368 from layer 5 to 25; -400 / +328 after layer 26); the default
    raise takes the raised trigger's layer-1 output past fp16's largest value."""
    neg = [sum(o for layer, o, _ in ms.MASSIVE_MLP_OUTPUTS if layer <= last) for last in (5, 26)]
    pos = [sum(o for layer, _, o in ms.MASSIVE_MLP_OUTPUTS if layer <= last) for last in (5, 26)]
    assert neg == [-7968.0, -320.0] and pos == [6368.0, 224.0]
    assert ms.GATE_VALUE / (1 + math.exp(-ms.GATE_VALUE)) == pytest.approx(ms.GATE_VALUE)
    assert 4192.0 * ms.DEFAULT_OUTLIER_SCALE > 65504.0 > 7648.0  # the raised one overflows, published ones not


@pytest.mark.parametrize("kwargs, message", [({"profile": "huge"}, "unknown stand-in profile"),
                                             ({"profile": "outliers", "outlier_scale": 0.0}, "positive number"),
                                             ({"profile": "outliers", "outlier_scale": math.nan}, "positive number")])
def test_bad_profile_or_scale_is_refused_before_writing(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ms.write_standin(tmp_path / "m", size="tiny", **kwargs)
    assert not (tmp_path / "m").exists()


def test_compare_passes_the_profile_to_the_stand_in(tmp_path, capsys, monkeypatch):
    """bench.compare --standin-profile outliers writes (or reuses) the outliers stand-in, in a cache dir
    of its own; without the option, the default one."""
    from bench import compare

    seen = []

    def fake_standin(out, size, seed, tokenizer_source, profile="default"):
        seen.append((Path(out).name, profile))
        raise RuntimeError("stop here")

    monkeypatch.setattr(ms, "write_standin", fake_standin)
    for argv in (["--standin-profile", "outliers"], []):
        assert compare.main(argv + ["--size", "tiny", "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err.startswith("error: stop here")
    assert seen == [("qwen2.5-1.5b-instruct-standin-tiny-outliers", "outliers"),
                    ("qwen2.5-1.5b-instruct-standin-tiny", "default")]
