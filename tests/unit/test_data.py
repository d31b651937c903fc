"""Data: verl-schema parquet / JSONL round trips, malformed rows named by file and row, synthetic
tasks (determinism, disjoint splits, answers the built-in rewards accept), the resumable loader and
chat-template encoding with a locally built tokenizer."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_tpu.config import load_config
from rl_tpu.data import (
    DataError,
    Example,
    PromptLoader,
    build_datasets,
    encode_prompts,
    load_examples,
    make_synthetic,
    write_jsonl,
    write_parquet,
)
from rl_tpu.data.synthetic import main as synthetic_main
from rl_tpu.rewards import arithmetic, countdown


def _fields(ex: Example) -> tuple:
    return (ex.data_source, ex.messages, ex.ground_truth, ex.ability, ex.extra_info, ex.reward_style)


def _row(**over) -> dict:
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 0},
    }
    row.update(over)
    return row


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
@pytest.mark.parametrize("writer", [write_parquet, write_jsonl])
def test_round_trip_verl_schema(task, writer, tmp_path):
    train, _ = make_synthetic(task, 50, 10, seed=1)
    path = writer(train, tmp_path / ("d.parquet" if writer is write_parquet else "d.jsonl"))
    back = load_examples([str(path)])
    assert [_fields(e) for e in back] == [_fields(e) for e in train]
    assert back[3].uid == f"{path.name}:{3 if writer is write_parquet else 4}"  # row 3 / line 4
    if writer is write_parquet:  # the columns and nesting verl's RLHFDataset reads
        table = pq.read_table(path)
        assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        row = table.slice(0, 1).to_pylist()[0]
        assert row["prompt"][0]["role"] == "user" and "ground_truth" in row["reward_model"]


def test_parquet_mixed_extra_info_and_uid(tmp_path):
    rows = [
        Example(
            data_source="a",
            messages=[{"role": "user", "content": "hi"}],
            ground_truth="1",
            extra_info={"index": 0},
        ),
        Example(
            data_source="a",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            ground_truth="2",
            extra_info={"uid": "q-7", "note": "x"},
        ),
    ]
    back = load_examples(write_parquet(rows, tmp_path / "m.parquet"))
    assert [b.extra_info for b in back] == [{"index": 0}, {"uid": "q-7", "note": "x"}]  # nulls dropped
    assert [b.uid for b in back] == ["m.parquet:0", "q-7"]
    assert back[1].messages == rows[1].messages
    # no extra_info at all is fine too (parquet cannot store an empty struct)
    bare = [Example(data_source="a", messages=[{"role": "user", "content": "x"}], ground_truth="1")]
    assert _fields(load_examples(write_parquet(bare, tmp_path / "b.parquet"))[0]) == _fields(bare[0])


def test_parquet_write_of_mixed_types_names_the_column(tmp_path):
    (arith, _), (count, _) = make_synthetic("arithmetic", 2, 1), make_synthetic("countdown", 2, 1)
    with pytest.raises(DataError, match="mix.parquet.*`reward_model`.*write_jsonl"):
        write_parquet(arith + count, tmp_path / "mix.parquet")
    back = load_examples(write_jsonl(arith + count, tmp_path / "mix.jsonl"))  # JSONL holds anything
    assert [b.ground_truth for b in back] == [e.ground_truth for e in arith + count]


@pytest.mark.parametrize(
    "row,error",
    [
        (_row(prompt=None), "missing field `prompt`"),
        ({k: v for k, v in _row().items() if k != "data_source"}, "missing field `data_source`"),
        (_row(prompt="What is 1+1?"), "`prompt` must be a list of chat messages.*wrap a plain string"),
        (_row(prompt=[]), "`prompt` is empty"),
        (_row(prompt=[{"role": "user", "content": "  "}]), "`prompt` is empty"),
        (_row(prompt=[{"role": "user"}]), r"`prompt\[0\].content` must be a string"),
        (_row(reward_model={"style": "rule"}), "missing field `reward_model.ground_truth`"),
        (_row(reward_model="2"), "`reward_model` must be an object"),
        (_row(data_source=3), "`data_source` must be a non-empty string"),
        (_row(extra_info=[1]), "`extra_info` must be an object"),
        ([1, 2], "a row must be an object"),
    ],
)
def test_malformed_jsonl_row_is_named(row, error, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_row()) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"bad.jsonl line 3: {error}"):
        load_examples([path])


def test_reads_a_verl_gsm8k_style_parquet_written_by_pyarrow(tmp_path):
    rows = [
        _row(extra_info={"split": "train", "index": i, "answer": "1+1=2 #### 2", "question": "What is 1+1?"})
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "gsm8k_train.parquet")
    back = load_examples(str(tmp_path / "gsm8k_train.parquet"))
    assert [(e.data_source, e.ground_truth, e.ability, e.extra_info["index"]) for e in back] == [
        ("openai/gsm8k", "2", "math", i) for i in range(3)
    ]
    assert back[0].messages == [{"role": "user", "content": "What is 1+1?"}]


@pytest.mark.parametrize("writer", ["parquet", "jsonl"])
def test_verl_agent_loop_rows_keep_tools_kwargs_and_interaction_kwargs(writer, tmp_path):
    """verl's multi-turn rows (its gsm8k_tool_agent_loop preprocessing): `extra_info.tools_kwargs` and
    `interaction_kwargs` come back as written. Parquet gives every row the keys any row has, as nulls:
    they are dropped at every depth, so a tool gets only its own row's kwargs."""
    extra = [
        {
            "index": 0,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72", "unit": "cm"}}},
            "interaction_kwargs": {"name": "gsm8k", "query": "q0", "ground_truth": "72"},
        },
        {
            "index": 1,
            "tools_kwargs": {
                "search": {"create_kwargs": {"ground_truth": "10"}, "execute_kwargs": {"top_k": 3}}
            },
            "interaction_kwargs": {"name": "gsm8k", "ground_truth": "10"},
        },
    ]
    rows = [_row(extra_info=e) for e in extra]
    path = tmp_path / f"agent.{writer}"
    if writer == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
        # what parquet itself stores for the second row: the first row's tool and keys, as nulls
        stored = pq.read_table(path).to_pylist()[1]["extra_info"]
        assert (
            stored["tools_kwargs"]["calc_gsm8k_reward"] is None
            and stored["interaction_kwargs"]["query"] is None
        )
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [e.extra_info for e in load_examples(path)] == extra


def test_write_parquet_stores_empty_tool_kwargs_objects(tmp_path):
    """Parquet cannot store a struct with no fields: `"execute_kwargs": {}` (verl rows write it) failed in
    pyarrow. It is written as null and read back absent, the same for a tool (nothing to merge)."""
    kwargs = {"multiply": {"create_kwargs": {"a": 1}, "execute_kwargs": {}}, "noop": {}}
    ex = Example(
        data_source="a",
        messages=[{"role": "user", "content": "x"}],
        ground_truth="1",
        extra_info={"tools_kwargs": kwargs},
    )
    back = load_examples(write_parquet([ex], tmp_path / "t.parquet"))[0]
    assert back.extra_info == {"tools_kwargs": {"multiply": {"create_kwargs": {"a": 1}}}}


def test_malformed_parquet_row_and_bad_files_are_named(tmp_path):
    rows = [_row(), _row(), _row(prompt=[])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet row 2: `prompt` is empty"):
        load_examples([tmp_path / "bad.parquet"])
    with pytest.raises(DataError, match="data.csv: unknown data file extension '.csv'"):
        load_examples([tmp_path / "data.csv"])
    with pytest.raises(DataError, match="missing.parquet: data file not found"):
        load_examples([tmp_path / "missing.parquet"])
    (tmp_path / "junk.jsonl").write_text('{"data_source": \n')
    with pytest.raises(DataError, match="junk.jsonl line 1: not valid JSON"):
        load_examples(tmp_path / "junk.jsonl")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        load_examples(tmp_path / "junk.parquet")


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_synthetic_deterministic_disjoint_and_stable_test_split(task):
    train, test = make_synthetic(task, 400, 60, seed=3)
    train2, test2 = make_synthetic(task, 400, 60, seed=3)
    assert [_fields(e) for e in train + test] == [_fields(e) for e in train2 + test2]
    other, _ = make_synthetic(task, 400, 60, seed=4)
    assert [e.messages for e in other] != [e.messages for e in train]
    assert (len(train), len(test)) == (400, 60)

    def key(e):
        if task == "countdown":
            return tuple(sorted(e.ground_truth["numbers"])), e.ground_truth["target"]
        return e.messages[0]["content"]

    assert len({key(e) for e in train + test}) == 460  # unique, so no test problem is in train
    _, test_small_train = make_synthetic(task, 10, 60, seed=3)
    assert [key(e) for e in test_small_train] == [key(e) for e in test]  # test split ignores train size
    assert len({e.uid for e in train + test}) == 460


def test_synthetic_answers_match_the_rewards():
    train, test = make_synthetic("arithmetic", 300, 30, seed=0)
    for e in train + test:
        a, b = e.messages[0]["content"].removeprefix("What is ").removesuffix("?").split("+")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert arithmetic.compute_score(e.data_source, str(int(a) + int(b)), e.ground_truth) == 1.0
        assert arithmetic.compute_score(e.data_source, str(int(a) + int(b) + 1), e.ground_truth) == 0.0
    train, test = make_synthetic("countdown", 300, 30, seed=0)
    for e in train + test:
        gt = e.ground_truth
        assert (
            countdown.compute_score(e.data_source, f"<answer>{e.extra_info['solution']}</answer>", gt) == 1.0
        )
        assert str(gt["target"]) in e.messages[0]["content"]


def test_synthetic_options_and_limits():
    train, _ = make_synthetic("arithmetic", 20, 5, seed=0, digits=1, ops="*-")
    assert all(len(e.messages[0]["content"]) <= len("What is 9*9?") for e in train)
    with pytest.raises(DataError, match="only 100 distinct problems"):
        make_synthetic("arithmetic", 100, 1, digits=1)
    with pytest.raises(DataError, match="unknown synthetic task 'sorting'"):
        make_synthetic("sorting", 1, 1)


def test_synthetic_cli_writes_loadable_splits(tmp_path, capsys):
    assert (
        synthetic_main(["countdown", "--out", str(tmp_path), "--train-size", "32", "--test-size", "8"]) == 0
    )
    assert "train.parquet" in capsys.readouterr().out
    train, test = load_examples(tmp_path / "train.parquet"), load_examples(tmp_path / "test.parquet")
    expect_train, expect_test = make_synthetic("countdown", 32, 8, seed=0)
    assert [_fields(e) for e in train + test] == [_fields(e) for e in expect_train + expect_test]


def _uids(batches):
    return [[e.uid for e in b] for b in batches]


def test_loader_epochs_are_permutations_and_resume_reproduces_the_order():
    examples, _ = make_synthetic("arithmetic", 10, 1, seed=0)
    loader = PromptLoader(examples, batch_size=4, shuffle=True, seed=7)
    first = _uids(next(loader) for _ in range(5))  # 20 examples: epochs 0 and 1 exactly
    flat = [u for b in first for u in b]
    assert sorted(flat[:10]) == sorted(e.uid for e in examples) == sorted(flat[10:])
    assert flat[:10] != flat[10:]  # a new permutation each epoch
    assert all(len(b) == 4 for b in first)

    loader = PromptLoader(examples, batch_size=4, shuffle=True, seed=7)
    for _ in range(3):  # stop mid-epoch: position 2 of epoch 1
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))  # survives a checkpoint file
    assert state == {"epoch": 1, "position": 2, "seed": 7, "shuffle": True, "num_examples": 10}
    expected = _uids(next(loader) for _ in range(6))
    resumed = PromptLoader(examples, batch_size=4, shuffle=True, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert _uids(next(resumed) for _ in range(6)) == expected
    assert _uids([next(PromptLoader(examples, 4, shuffle=False))]) == [[e.uid for e in examples[:4]]]

    with pytest.raises(DataError, match="saved for 10 examples but the data set now has 9"):
        PromptLoader(examples[:9], 4).load_state_dict(state)
    with pytest.raises(DataError, match="needs at least one example"):
        PromptLoader([], 4)


def test_encode_prompts_applies_the_chat_template(tiny_qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    (arith, _), (count, _) = make_synthetic("arithmetic", 3, 1), make_synthetic("countdown", 2, 1)
    examples = arith + count
    ids = encode_prompts(tok, examples, max_prompt_length=128)
    for e, seq in zip(examples, ids):
        assert (
            seq == tok.apply_chat_template(e.messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        )
    assert tok.decode(ids[0]).endswith(
        arith[0].messages[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(
        DataError, match=f"example '{count[0].uid}' has {len(ids[3])} tokens.*max_prompt_length=30"
    ):
        encode_prompts(tok, examples, max_prompt_length=30)
    cut = encode_prompts(tok, examples, max_prompt_length=30, truncation="left")
    assert cut[0] == ids[0] and cut[3] == ids[3][-30:]


def test_build_datasets_from_config(tmp_path):
    cfg = load_config(
        None, ["--data.synthetic=countdown", "--data.synthetic_train_size=16", "--data.synthetic_test_size=4"]
    )
    train, test = build_datasets(cfg.data)
    assert (len(train), len(test), train[0].data_source) == (16, 4, "countdown")
    path = write_jsonl(train[:5], tmp_path / "t.jsonl")
    cfg = load_config(None, [f'--data.train_files=["{path}"]'])
    train, test = build_datasets(cfg.data)
    assert [_fields(e) for e in train] == [_fields(e) for e in make_synthetic("countdown", 16, 4)[0][:5]]
    assert test == []


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_a_directory_of_shards_loads_in_name_order(writer, tmp_path):
    # verl users keep large sets as folders of shards; the shards are read in name order, whatever order
    # they were written in, and a shard may be empty
    train, _ = make_synthetic("arithmetic", 9, 1, seed=2)
    ext = ".parquet" if writer is write_parquet else ".jsonl"
    folder = tmp_path / "train"
    writer(train[5:], folder / f"part-00001{ext}")
    writer(train[:5], folder / f"part-00000{ext}")
    (folder / "README.md").write_text("not data")  # other files are ignored
    if writer is write_jsonl:
        (folder / "part-00002.jsonl").write_text("")
    back = load_examples(folder)
    assert [_fields(e) for e in back] == [_fields(e) for e in train]
    assert back[0].uid.startswith("part-00000") and back[5].uid.startswith("part-00001")
    cfg = load_config(None, [f"--data.train_files={folder}"])
    assert [_fields(e) for e in build_datasets(cfg.data)[0]] == [_fields(e) for e in train]


def test_a_directory_without_shards_or_with_two_kinds_is_named(tmp_path):
    with pytest.raises(DataError, match=r"empty is a directory with no \*.parquet or \*.jsonl files"):
        (tmp_path / "empty").mkdir()
        load_examples(tmp_path / "empty")
    mixed = tmp_path / "mixed"
    write_jsonl(make_synthetic("arithmetic", 2, 1)[0], mixed / "a.jsonl")
    write_parquet(make_synthetic("arithmetic", 2, 1)[0], mixed / "b.parquet")
    with pytest.raises(DataError, match=r"mixed is a directory mixing 1 \*.parquet and 1 \*.jsonl files"):
        load_examples(mixed)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"blank is a directory whose 1 data file\(s\) have no rows"):
        load_examples(tmp_path / "blank")


def test_synthetic_options_from_the_config_and_a_wrong_option_named():
    from rl_tpu.config import load_config
    from rl_tpu.data import build_datasets

    cfg = load_config(
        None,
        [
            '--data.synthetic_options={digits = 1, ops = "+*"}',
            "--data.synthetic_train_size=150",
            "--data.synthetic_test_size=50",
        ],
    )
    train, test = build_datasets(cfg.data)
    questions = [e.messages[0]["content"] for e in train + test]
    assert len(set(questions)) == 200  # the whole space of one-digit sums and products, none twice
    assert {q[9] for q in questions} == {"+", "*"} and all(len(q) == 12 for q in questions)  # "What is 7*8?"
    cfg.data.synthetic_options = {"digit": 1}
    with pytest.raises(DataError, match=r"unknown option\(s\) \['digit'\].*\['digits', 'ops'\]"):
        build_datasets(cfg.data)
