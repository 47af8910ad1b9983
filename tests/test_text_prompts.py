"""Your own checkpoint: text prompts through its own tokenizer, the verdict, the CI gate.

The checkpoint is a tiny random Qwen3-MoE saved with a real word-level tokenizer
trained here with the `tokenizers` library (and a chat template), so nothing downloads.
"""

import json
import xml.etree.ElementTree as ET

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fxreplace.capture import capture_reference, tokenize_prompts
from fxreplace.cli import main as cli
from fxreplace.models import tiny_model
from fxreplace.reference import load_reference

ARCH = "Qwen3MoeForCausalLM"
SENTENCES = ["the router picks two experts for every token", "a compiled model drifts from its reference",
             "replace the router logits and see whether the drift goes away", "hello world"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def word_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(vocab_size=100, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint with its tokenizer beside it."""
    directory = tmp_path_factory.mktemp("ckpt") / "model"
    tiny_model(ARCH).save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return directory


def test_text_and_chat_prompts_become_the_tokenizers_ids_and_are_recorded():
    tokenizer = word_tokenizer()
    chat = [{"role": "user", "content": "hello world"}]
    ids, texts = tokenize_prompts(["hello world", chat, [5, 6, 7]], tokenizer)
    hello, world = tokenizer.convert_tokens_to_ids(["hello", "world"])
    user, assistant = tokenizer.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    assert ids == [[hello, world], [user, hello, world, assistant], [5, 6, 7]]
    assert texts == ["hello world", "<|user|> hello world <|assistant|>", None]
    assert tokenize_prompts(["hello world"], tokenizer, chat=True)[0] == [[user, hello, world, assistant]]
    with pytest.raises(ValueError, match="prompt 0 is text but no tokenizer was given: pass the checkpoint's tokenizer"):
        tokenize_prompts(["hello"], None)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="prompt 1 is a chat conversation but the tokenizer has no chat template"):
        tokenize_prompts([[1, 2], chat], tokenizer)


def test_python_api_captures_text_prompts_and_records_their_texts():
    model, tokenizer = tiny_model(ARCH), word_tokenizer()
    reference = capture_reference(model, ["the router picks", [3, 4]], ["model.layers.*.mlp.gate"], 2,
                                  tokenizer=tokenizer, progress=False)
    assert reference.prompt_tokens(0) == tokenizer("the router picks")["input_ids"]
    assert reference.metadata["prompt_texts"] == ["the router picks", None]


def test_cli_text_prompts_capture_validate_gate_junit_and_blame(checkpoint, tmp_path, capsys):
    """The acceptance path: plain and chat prompts from files, validate with a gate and
    JUnit, blame with JUnit, the same verdict in the terminal, result.json and report.html."""
    (tmp_path / "plain.json").write_text(json.dumps(["the router picks two experts", "hello world"]))
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "a compiled model drifts"}]}) + "\n"
        + json.dumps({"prompt": "replace the router logits"}) + "\n")
    assert cli(["capture", str(checkpoint), "--prompts", str(tmp_path / "plain.json"), "--max-new-tokens", "4",
                "--out", str(tmp_path / "plain")]) == 0
    assert load_reference(tmp_path / "plain").metadata["prompt_texts"] == ["the router picks two experts", "hello world"]
    assert cli(["capture", str(checkpoint), "--prompts", str(tmp_path / "chat.jsonl"), "--chat", "--components",
                "--max-new-tokens", "4", "--out", str(tmp_path / "ref")]) == 0
    texts = load_reference(tmp_path / "ref").metadata["prompt_texts"]
    assert texts == ["<|user|> a compiled model drifts <|assistant|>", "<|user|> replace the router logits <|assistant|>"]
    capsys.readouterr()

    report = tmp_path / "report"
    code = cli(["validate", str(checkpoint), "--reference", str(tmp_path / "ref"), "--report-dir", str(report),
                "--fail-on", "kl=0", "--junit", str(tmp_path / "validate.xml")])
    out = capsys.readouterr().out
    assert code == 1, "bf16 against an fp32 reference has some KL: a gate of kl=0 fails"
    result = json.loads((report / "result.json").read_text())
    sentence = result["verdict"]["sentence"]
    assert result["verdict"]["outcome"] in {"no_divergence", "explained", "contributes", "not_the_cause"}
    assert f"verdict: {sentence}" in out and "gate failed (--fail-on kl=0): 2 of 2 prompts" in out
    page = (report / "report.html").read_text()
    assert sentence.replace(">", "&gt;") in page and "a compiled model drifts" in page
    assert result["prompt_texts"] == {"0": texts[0], "1": texts[1]}
    cases = ET.parse(tmp_path / "validate.xml").getroot().findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == ["prompt 0", "prompt 1"]
    assert all("mean KL" in c.find("failure").get("message") for c in cases)

    assert cli(["validate", str(checkpoint), "--reference", str(tmp_path / "ref"), "--report-dir", str(report),
                "--fail-on", "kl=1e9", "--fail-on", "top5=1e9", "--junit", str(tmp_path / "pass.xml")]) == 0
    assert "gate passed" in capsys.readouterr().out
    suite = ET.parse(tmp_path / "pass.xml").getroot().find("testsuite")
    assert suite.get("tests") == "2" and suite.get("failures") == "0"

    assert cli(["blame", str(checkpoint), "--reference", str(tmp_path / "ref"), "--report-dir", str(report),
                "--junit", str(tmp_path / "blame.xml")]) == 0
    blamed = json.loads((report / "blame.json").read_text())
    cases = ET.parse(tmp_path / "blame.xml").getroot().findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == [b["component"] for b in blamed["ranking"]]
    assert "<a href='blame.html'>" in (report / "report.html").read_text(), "validate's page links to blame's"
    assert "<a href='report.html'>" in (report / "blame.html").read_text(), "blame's page links back"


def test_text_prompts_without_a_tokenizer_say_to_pass_token_ids(tmp_path, capsys, no_model_loads):
    tiny_model(ARCH).save_pretrained(tmp_path / "bare")
    (tmp_path / "p.json").write_text(json.dumps(["hello world"]))
    capsys.readouterr()
    for model in (str(tmp_path / "bare"), f"builtin:{ARCH}"):
        with pytest.raises(SystemExit) as raised:
            cli(["capture", model, "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "ref")])
        assert raised.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: text prompts in ") and "needs a tokenizer but" in err
        assert "hint: give --prompts as token id lists" in err and "\n" not in err
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": 3}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl line 2: a dict with neither 'prompt' nor 'messages' \(it has "
                                         r"\['text'\]\); hint: a JSON list of texts"):
        cli(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "ref")])
    for data, says in (([1, 2, 3], r"item 0: 1 is a number, not a prompt: .*\(\[\[1, 2, 3\]\], not \[1, 2, 3\]\)"),
                       ([[1.0, 2.0]], r"item 0: token id 1.0 is a float; token ids are non-negative integers"),
                       ([[5, -1]], r"item 0: token id -1 is negative"), ([[]], r"item 0: an empty prompt")):
        (tmp_path / "bad.json").write_text(json.dumps(data))
        with pytest.raises(SystemExit, match=says):
            cli(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "bad.json"), "--out", str(tmp_path / "ref")])
