"""YAML run configuration: named configs, overrides, errors, round trip, field docs."""

import dataclasses
import typing

import pytest

from axo4d.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    SourceConfig,
    TrainConfig,
    check_values,
    config_from_dict,
    config_to_dict,
    dump_config,
    field_docs,
    load_config,
    model_from_name,
    named_configs,
    parse_overrides,
    resolve_config_path,
)
from axo4d.config.errors import ConfigError
from axo4d.facts.grid import Grid

CONFIG_CLASSES = [
    ModelConfig,
    DataConfig,
    SourceConfig,
    TrainConfig,
    ParallelConfig,
    CheckpointConfig,
    EvalConfig,
    RunConfig,
]

# docs/design.md section 6: name -> (layers, hidden, heads); sequence 2048
REFERENCE = {
    "gpt-5b": (24, 4096, 32),
    "gpt-10b": (32, 5120, 40),
    "gpt-20b": (32, 7168, 56),
    "gpt-40b": (38, 9216, 72),
    "gpt-60b": (56, 9216, 72),
    "gpt-80b": (42, 12288, 96),
    "gpt-160b": (84, 12288, 96),
    "gpt-320b": (96, 16384, 128),
    "gpt-640b": (192, 16384, 128),
}


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---- named configs ---------------------------------------------------------------------
def test_named_configs_present():
    names = named_configs()
    assert names == sorted(names)
    for n in ["tiny", "small", "gpt2-124m", *REFERENCE]:
        assert n in names


@pytest.mark.parametrize("name", named_configs())
def test_named_config_loads_and_divides(name):
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)
    assert cfg.name == name
    m = cfg.model
    assert m.n_layer >= 1 and m.n_embd >= 1 and m.n_head >= 1 and m.seq_len >= 1
    assert m.n_embd % m.n_head == 0
    assert m.vocab_size >= 256
    t = cfg.train
    assert t.global_batch % t.grad_accum == 0
    assert 0 < t.min_lr <= t.lr
    assert t.warmup_steps <= t.steps
    # the grid spec in the config parses
    g = Grid.parse(cfg.parallel.grid, cfg.parallel.order)
    assert g.world_size >= 1
    assert model_from_name(name) == m


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_family_shapes(name):
    m = load_config(name).model
    assert (m.n_layer, m.n_embd, m.n_head) == REFERENCE[name]
    assert m.seq_len == 2048
    assert m.n_embd // m.n_head == 128  # head dim of the family


def test_unknown_named_config_lists_valid():
    with pytest.raises(ConfigError) as e:
        load_config("gpt-7b")
    msg = str(e.value)
    assert "'gpt-7b'" in msg and "tiny" in msg and "gpt-5b" in msg


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="does not exist") as e:
        load_config(missing)
    assert "nope.yaml" in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config_path(str(tmp_path / "sub" / "x"))


# ---- overrides ---------------------------------------------------------------------------
def test_set_overrides_coerce_types():
    cfg = load_config(
        "tiny",
        [
            "train.steps=7",
            "train.lr=3e-4",
            "train.min_lr=1e-5",
            "train.compile=true",
            "train.activation_checkpointing=True",
            "parallel.overlap=false",
            "data.source=/some/dir",
            "data.cache_dir=123",
            "model.n_layer=3",
            "train.grad_clip=0",
            "parallel.timeout_s=5",
            "train.peak_tflops=1_000",
        ],
    )
    t = cfg.train
    assert t.steps == 7 and type(t.steps) is int
    assert t.lr == pytest.approx(3e-4) and type(t.lr) is float
    assert t.min_lr == pytest.approx(1e-5)
    assert t.compile is True and t.activation_checkpointing is True
    assert cfg.parallel.overlap is False
    assert cfg.data.source == "/some/dir"
    assert cfg.data.cache_dir == "123" and type(cfg.data.cache_dir) is str
    assert cfg.model.n_layer == 3
    assert t.grad_clip == 0.0 and type(t.grad_clip) is float
    assert cfg.parallel.timeout_s == 5.0 and type(cfg.parallel.timeout_s) is float
    assert t.peak_tflops == 1000.0
    # untouched keys keep the named config's values
    base = load_config("tiny")
    assert cfg.model.n_embd == base.model.n_embd and cfg.train.global_batch == base.train.global_batch
    assert cfg.name == "tiny"


def test_set_name_and_grid_argument():
    cfg = load_config("tiny", ["name=exp1"], grid="x=2,y=2")
    assert cfg.name == "exp1"
    assert cfg.parallel.grid == "x=2,y=2"
    assert load_config("tiny", ["parallel.grid=z=2"]).parallel.grid == "z=2"  # '=' in the value


def test_parse_overrides():
    assert parse_overrides(["a.b=1", "a.c=x", "d=true", "e="]) == {"a": {"b": 1, "c": "x"}, "d": True, "e": ""}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["train.steps"])
    with pytest.raises(ConfigError, match="malformed key"):
        parse_overrides(["train..steps=1"])
    with pytest.raises(ConfigError, match="is not a section"):
        parse_overrides(["train=1", "train.steps=2"])


@pytest.mark.parametrize(
    "override, key, valid",
    [
        ("bogus=1", "'bogus'", ["model", "train", "parallel", "checkpoint", "data", "name"]),
        ("train.stepz=1", "'train.stepz'", ["steps", "lr", "global_batch"]),
        ("model.layers=2", "'model.layers'", ["n_layer", "n_embd", "n_head"]),
        ("trian.steps=1", "'trian'", ["train"]),
    ],
)
def test_unknown_keys_named_with_valid_ones(override, key, valid):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    msg = str(e.value)
    assert "unknown config key" in msg and key in msg
    listed = msg.split("valid keys")[1]
    for v in valid:
        assert v in listed


@pytest.mark.parametrize(
    "override, key, what",
    [
        ("train.steps=abc", "train.steps", "integer"),
        ("train.steps=1.5", "train.steps", "integer"),
        ("train.steps=true", "train.steps", "integer"),
        ("train.lr=fast", "train.lr", "number"),
        ("train.lr=true", "train.lr", "number"),
        ("train.compile=maybe", "train.compile", "true or false"),
        ("train.compile=2", "train.compile", "true or false"),
        ("data.source=[1, 2]", "data.source", "string"),
        ("model=5", "model", "mapping"),
        ("train=fast", "train", "mapping"),
        ("model.n_layer.x=1", "model.n_layer", "integer"),
    ],
)
def test_wrong_types(override, key, what):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    msg = str(e.value)
    assert repr(key) in msg and what in msg


# ---- files -------------------------------------------------------------------------------
def test_malformed_yaml(tmp_path):
    p = _write(tmp_path, "bad.yaml", "model: {n_layer: 2\ntrain: [\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        load_config(str(p))
    assert "bad.yaml" in str(e.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "42\n", "just a string\n"])
def test_yaml_top_level_not_a_mapping(tmp_path, text):
    p = _write(tmp_path, "list.yaml", text)
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(str(p))


def test_empty_yaml_is_an_error_and_braces_are_defaults(tmp_path):
    """An empty file (or one of comments) trained the default model without a word (issue 22); an
    explicit empty mapping still means the defaults."""
    for text in ("", "# nothing here yet\n"):
        with pytest.raises(ConfigError, match="is empty: give a named config as its base"):
            load_config(str(_write(tmp_path, "empty.yaml", text)))
    cfg = load_config(str(_write(tmp_path, "braces.yaml", "{}\n")))
    assert cfg == dataclasses.replace(RunConfig(), name="braces")


def test_numbers_beyond_what_training_can_use():
    """Found by a probe (issue 22): train.lr=1e300 crashed every rank in the optimizer after --out
    was reset; train.steps=99999999999999999999999 was accepted; nan/inf passed as numbers."""
    with pytest.raises(ConfigError, match=r"'train.steps'=99999999999999999999999 is too large: .* 2\*\*63-1"):
        load_config("tiny", ["train.steps=99999999999999999999999"])
    for bad in ("train.lr=nan", "train.lr=.inf", "parallel.timeout_s=inf"):
        with pytest.raises(ConfigError, match="must be a finite number"):
            load_config("tiny", [bad])
    cases = [
        ("train.lr=1e300", r"train.lr=1e\+300 is beyond the largest float32"),
        ("train.eps=1e39", r"train.eps=1e\+39 is beyond the largest float32"),
        ("train.beta2=1.0", r"train.beta2=1.0 must be in \[0, 1\)"),
        ("train.eps=0", "train.eps=0.0 must be > 0"),
        ("checkpoint.signals=SIGKILL", "'SIGKILL' is not one of SIGUSR1, SIGUSR2, SIGTERM"),
        ("parallel.trace_collectives=-1", "parallel.trace_collectives=-1 must be >= 0"),
    ]
    for s, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            check_values(load_config("tiny", [s]))
    check_values(load_config("tiny", ["train.lr=1e30", "checkpoint.signals=usr1, TERM", "checkpoint.async=false"]))


def test_python_keyword_keys():
    """``checkpoint.async`` is the field ``async_``: YAML and --set use the key, dumps write it back."""
    cfg = load_config("tiny", ["checkpoint.async=true"])
    assert cfg.checkpoint.async_ == "true"
    assert config_to_dict(cfg)["checkpoint"]["async"] == "true" and "async_" not in config_to_dict(cfg)["checkpoint"]
    assert config_from_dict(config_to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="valid keys under checkpoint: async, at_end"):
        load_config("tiny", ["checkpoint.asynch=true"])
    with pytest.raises(ConfigError, match="checkpoint.async='sometimes'; valid: auto, true, false"):
        load_config("tiny", ["checkpoint.async=sometimes"])


def test_unknown_key_in_file(tmp_path):
    p = _write(tmp_path, "c.yaml", "model: {n_layer: 2, dropout: 0.1}\n")
    with pytest.raises(ConfigError, match="'model.dropout'"):
        load_config(str(p))


def test_base_inheritance(tmp_path):
    tiny = load_config("tiny")
    p = _write(tmp_path, "child.yaml", "base: tiny\nmodel: {n_layer: 5}\ntrain: {lr: 1.0e-2}\n")
    cfg = load_config(str(p))
    assert cfg.name == "child"
    assert cfg.model.n_layer == 5
    assert cfg.model.n_embd == tiny.model.n_embd  # deep merge: siblings kept
    assert cfg.model.vocab_multiple == tiny.model.vocab_multiple
    assert cfg.train.lr == 1e-2
    assert cfg.train.steps == tiny.train.steps
    assert cfg.data == tiny.data
    # a chain: grandchild -> child (by path) -> tiny; overrides apply last
    q = _write(tmp_path, "grand.yaml", f"base: {p}\ntrain: {{steps: 3}}\n")
    g = load_config(str(q), ["model.n_head=2"])
    assert (g.model.n_layer, g.train.steps, g.train.lr, g.model.n_head) == (5, 3, 1e-2, 2)
    # an unknown base is an error naming it
    r = _write(tmp_path, "orphan.yaml", "base: no-such-config\n")
    with pytest.raises(ConfigError, match="no-such-config"):
        load_config(str(r))


def test_base_cycle_is_an_error(tmp_path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text(f"base: {b}\n")
    b.write_text(f"base: {a}\n")
    with pytest.raises(ConfigError, match="too deep"):
        load_config(str(a))


@pytest.mark.parametrize("name", ["tiny", "gpt-5b", "small"])
def test_dump_load_round_trip(tmp_path, name):
    cfg = load_config(name, ["train.lr=3e-4", "train.compile=true", "parallel.grid=x=2,z=2"])
    path = tmp_path / "dumped.yaml"
    dump_config(cfg, path)
    back = load_config(str(path))
    assert back == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


# ---- dataclasses -------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_field_documented(cls):
    docs = field_docs(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    undocumented = [n for n in names if not docs.get(n, "").strip()]
    assert not undocumented, f"{cls.__name__}: fields without a docstring: {undocumented}"
    assert all("\n" not in d for d in docs.values())


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_frozen_and_types(cls):
    obj = cls()
    f = dataclasses.fields(cls)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, f.name, getattr(obj, f.name))
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        tp, value = hints[fld.name], getattr(obj, fld.name)
        if typing.get_origin(tp) is typing.Literal:  # a choice: its default is one of them
            assert value in typing.get_args(tp), fld.name
        elif typing.get_origin(tp) is tuple:  # tuple[X, ...]: a list of X in YAML
            assert isinstance(value, tuple) and all(isinstance(v, typing.get_args(tp)[0]) for v in value), fld.name
        else:
            assert isinstance(value, tp), fld.name


@pytest.mark.parametrize(
    "key,value,valid",
    [
        ("train.dtype", "fp16", "auto, fp32, bf16"),
        ("train.offload", "gpu", "none, optimizer, auto"),
        ("train.nonfinite", "ignore", "stop, skip"),
        ("parallel.shard_optimizer", "maybe", "auto, true, false"),
        ("parallel.backend", "ucx", "auto, nccl, gloo, mpi"),
        ("data.token_dtype", "int8", "auto, uint16, uint32"),
        ("model.rope_scaling", "yarn", "'', llama3"),
    ],
)
def test_choices_are_checked_once_by_the_loader(key, value, valid):
    """Choice-valued fields are ``Literal`` types: the loader names the key, the value and the valid ones."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"{key}={value}"])
    assert str(e.value) == f"{key}={value!r}; valid: {valid}"


def test_yaml_booleans_read_as_choice_words():
    assert load_config("tiny", ["parallel.shard_optimizer=true"]).parallel.shard_optimizer == "true"
    assert load_config("tiny", ["parallel.shard_optimizer=off"]).parallel.shard_optimizer == "false"


def test_defaults_consistent():
    m = ModelConfig()
    assert m.n_embd % m.n_head == 0
    Grid.parse(ParallelConfig().grid, ParallelConfig().order)


def test_eval_section():
    """eval.tasks is a list of task names (a YAML list through --set); unknown eval keys are errors."""
    cfg = load_config("tiny", ["eval.tasks=[axo4d_mc, axo4d_roll]", "eval.interval=5"])
    assert cfg.eval.tasks == ("axo4d_mc", "axo4d_roll") and cfg.eval.interval == 5
    assert load_config("tiny").eval.tasks == ()
    with pytest.raises(ConfigError, match="eval.nope"):
        load_config("tiny", ["eval.nope=1"])


def test_yaml_off_is_a_choice_word_where_off_is_valid(tmp_path):
    """YAML 1.1 reads ``off``/``on``/``no`` as booleans: a Literal with 'off' takes False as 'off'."""
    p = tmp_path / "c.yaml"
    p.write_text("base: tiny\ntrain: {fp8: off}\nparallel: {shard_optimizer: no}\n")
    cfg = load_config(str(p))
    assert cfg.train.fp8 == "off" and cfg.parallel.shard_optimizer == "false"
    p.write_text("base: tiny\ntrain: {fp8: on}\n")  # no valid word for True: refused, naming the choices
    with pytest.raises(ConfigError, match=r"train.fp8=True; valid: off, tensorwise, rowwise"):
        load_config(str(p))


def test_init_from_yaml_and_set_win_over_config_json(tmp_path):
    """Under --init-from the model section is config.json, then the user's YAML model keys, then
    --set model.*; a bundled base's model keys do not win; the start-up line names each source."""
    import json

    from axo4d.training.init_from import config_with_init, model_sources

    hf = tmp_path / "hf"
    hf.mkdir()
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "max_position_embeddings": 256,
    }
    (hf / "config.json").write_text(json.dumps(raw))
    yml = tmp_path / "ft.yaml"
    yml.write_text("base: tiny\nmodel: {seq_len: 128, init_std: 0.01}\ntrain: {steps: 3}\n")
    sets = ["model.seq_len=64"]
    cfg = config_with_init(load_config(str(yml), sets), hf, sets, str(yml))
    m = cfg.model
    assert (m.arch, m.n_layer, m.n_embd, m.vocab_size) == ("llama", 3, 64, 300)  # config.json, not tiny's
    assert m.init_std == 0.01 and m.seq_len == 64  # the YAML's key; --set over the YAML
    line = model_sources(cfg, hf, sets, str(yml))
    assert line.startswith("model: arch=llama (config.json), n_layer=3 (config.json)")
    assert "seq_len=64 (--set)" in line and "init_std=0.01 (yaml)" in line
    # a named config contributes no model keys: config.json wins
    cfg = config_with_init(load_config("small"), hf, [], "small")
    assert (cfg.model.n_layer, cfg.model.seq_len) == (3, 256)
    assert "(yaml)" not in model_sources(cfg, hf, [], "small")
