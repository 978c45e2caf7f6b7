"""The chat formats of the 2025-26 families, masked right (tests/family_templates.py's shapes of the real templates):
gpt-oss's Harmony channels (the final answer trained, the analysis channel prompt unless asked for, tool calls in
Harmony's own syntax), Qwen3.5's thinking blocks (kept for the turns after the last user query, stripped from earlier
ones, as its template does), Gemma 4's and Llama 4's turns with tool calls, GLM-4.5's replies ended by the stop token
that opens the next turn, multi-turn Harmony (a past answer's <|end|> untrained) and Phi-3.5's replies. Every example
is the template's own rendering token for token (GLM-4.5's with its end token appended after the last reply), and no
tool call is dropped (data/fidelity.py's check runs inside encode). Every template on conversations of every length:
tests/test_chat_multiturn.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rocktune.data.chat import to_chat
from rocktune.data.encode import IGNORE, chat_segments, encode
from tests.family_fixtures import BY_NAME, TEMPLATES, build_tokenizer, trained_spans
from tests.family_templates import RELEASED

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def _tok(family: str):
    return build_tokenizer(TEMPLATES[BY_NAME[family].template])


def _encode(tok, rec: dict, appended: str = ""):
    """(input ids, the trained spans decoded) of a record, checked to be the template's own rendering (and the end
    token ``appended`` after it, where the template writes none after the last reply)."""
    chat = to_chat(rec, "row 1", {})
    enc = encode(chat, "messages", tok, 4096, False, "row 1")
    extra = {"tools": chat["tools"]} if chat.get("tools") else {}
    own = tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=True, **extra)["input_ids"]
    assert enc.input_ids == list(own) + ([tok.convert_tokens_to_ids(appended)] if appended else [])
    return enc, trained_spans(tok, enc)


def test_harmony_trains_the_final_answer_not_the_analysis_channel():
    tok = _tok("gpt-oss")
    rec = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "thinking": "Add two and two.", "content": "4"}]}
    enc, spans = _encode(tok, rec)
    assert spans == ["<|channel|>final<|message|>4<|return|>"]
    assert "<|channel|>analysis<|message|>Add two and two.<|end|>" in tok.decode(enc.input_ids)  # shown, not trained


def test_harmony_analysis_is_trained_when_asked():
    tok = _tok("gpt-oss")
    msgs = to_chat({"messages": [{"role": "user", "content": "2+2?"},
                                 {"role": "assistant", "reasoning_content": "Add them.", "content": "4"}]}, "r", {})
    segments = chat_segments(msgs["messages"], tok, "r", train_reasoning=True)
    assert [text for text, trained in segments if trained] == [
        "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"]


def test_harmony_tool_calls_are_trained_in_harmony_syntax():
    tok = _tok("gpt-oss")
    rec = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "I need the tool.", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]}
    enc, spans = _encode(tok, rec)
    assert spans == [' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
                     "<|channel|>final<|message|>Sunny.<|return|>"]
    text = tok.decode(enc.input_ids)
    assert "type get_weather = (_: " in text and "<|start|>functions.get_weather to=assistant" in text


def test_harmony_multi_turn_trains_what_the_model_writes():
    """A Harmony conversation of several turns (developer instructions, reasoning on earlier and last turns, a tool
    call and its result between turns) is the template's rendering token for token. A past final answer ends with
    <|end|> in the history, where the model wrote <|return|> (the template's own comment: <|return|> ends generation,
    <|end|> does not): its text is trained, its <|end|> is prompt, so the model only ever learns to end an answer
    where generation stops. The call ends with <|call|> (a stop), the last answer with <|return|>, both trained;
    reasoning the template drops (earlier turns, a call's once a final answer follows) is gone, the last turn's
    analysis is shown and not trained."""
    from rocktune.data.checks import check_training_data
    from rocktune.data.dataset import Examples

    tok = _tok("gpt-oss")
    rec = {"tools": TOOLS, "messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "thinking": "Greet back.", "content": "Hello."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "I need the tool.", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": "sunny"}, {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"}, {"role": "assistant", "thinking": "Be polite.", "content": "Bye."}]}
    enc, spans = _encode(tok, rec)
    assert spans == ["<|channel|>final<|message|>Hello.",
                     ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
                     "<|channel|>final<|message|>Sunny.", "<|channel|>final<|message|>Bye.<|return|>"]
    text = tok.decode(enc.input_ids)
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in text
    assert "final<|message|>Hello.<|end|><|start|>user" in text and "final<|message|>Sunny.<|end|>" in text
    assert "Greet back." not in text and "I need the tool." not in text
    assert "<|start|>assistant<|channel|>analysis<|message|>Be polite.<|end|><|start|>assistant" in text
    end = tok.convert_tokens_to_ids("<|end|>")
    # system, developer, 3 user turns, the tool result, 2 past answers, the last turn's analysis: none trained
    assert [label for i, label in zip(enc.input_ids, enc.labels, strict=True) if i == end] == [IGNORE] * 9
    chat = to_chat(rec, "row 1", {})
    assert check_training_data(Examples([enc.input_ids], [enc.labels]), tok, "messages", False,
                               [("row 1", chat)]) == []


def test_phi35_replies_end_where_the_template_ends_them():
    """Phi-3.5's released template ends every reply with <|end|>\n and closes the conversation with its EOS: a past
    reply was cut after "<|" (the common start of <|endoftext|> and <|user|>), trained as two bytes of text, so the
    tokens were not the template's; now each reply is trained through its <|end|>\n, the last one with the EOS."""
    from tests.family_fixtures import Template

    text = (RELEASED / "microsoft-Phi-3.5-mini-instruct.jinja").read_text(encoding="utf-8")
    tok = build_tokenizer(Template(text, ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                                   "<|endoftext|>", "<|endoftext|>"))
    rec = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
                        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
                        {"role": "assistant", "content": "A2"}]}
    _, spans = _encode(tok, rec)
    assert spans == ["A1<|end|>\n", "A2<|end|>\n<|endoftext|>"]


def test_qwen35_keeps_thinking_after_the_last_query_and_strips_it_before():
    """Qwen3.5's released template: the generation prompt opens the think block, so a reply after the last user
    query is trained from inside it; a reply before it has no think block (its reasoning dropped, as the template
    drops it) and is trained from its text."""
    tok = _tok("qwen3.5")
    rec = {"messages": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "reasoning_content": "old thought", "content": "one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "<think>\nnew thought\n</think>\n\ntwo"}]}
    enc, spans = _encode(tok, rec)
    text = tok.decode(enc.input_ids)
    assert "old thought" not in text  # a past turn's reasoning: stripped by the template, so by training
    assert "<|im_start|>assistant\none<|im_end|>" in text
    assert spans == ["one<|im_end|>\n", "new thought\n</think>\n\ntwo<|im_end|>\n"]


def test_qwen35_tool_call_and_result():
    tok = _tok("qwen3.5")
    rec = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]}
    enc, spans = _encode(tok, rec)
    # both replies follow the last user query: each opens a think block, the call in Qwen3.5's XML syntax
    assert spans == ["\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "</function>\n</tool_call><|im_end|>\n", "\n</think>\n\nSunny.<|im_end|>\n"]
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in tok.decode(enc.input_ids)


def test_qwen35_agent_trace_with_reasoning_before_a_later_query():
    """An agent trace (reasoning, a call, its result, an answer) followed by another user turn: the template drops the
    first round's reasoning once the later query comes, so each reply is located as the whole conversation renders
    it (a prefix ending in the first round still shows it)."""
    tok = _tok("qwen3.5")
    rec = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "I need the tool.", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "reasoning_content": "It said sunny.", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "reasoning_content": "Be polite.", "content": "You are welcome."}]}
    enc, spans = _encode(tok, rec)
    assert spans == ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                     "</tool_call><|im_end|>\n", "Sunny.<|im_end|>\n",
                     "Be polite.\n</think>\n\nYou are welcome.<|im_end|>\n"]
    assert "I need the tool." not in tok.decode(enc.input_ids)


@pytest.mark.parametrize(("family", "call", "end"), [
    ("gemma4", '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|><turn|>\n', "Sunny.<turn|>\n"),
    ("llama4", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot|>', "Sunny.<|eot|>"),
])
def test_tool_calls_of_gemma4_and_llama4(family, call, end):
    tok = _tok(family)
    rec = {"messages": [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": " Sunny. "}]}
    _, spans = _encode(tok, rec)
    assert spans == [call, end]


def test_gemma4_released_template_trains_calls_and_answers():
    """Gemma 4's released template: its generation prompt opens an empty thought channel a past reply does not have,
    so replies are trained from after the turn header; a call is trained up to the <|tool_response> that opens its
    result inside the model's turn, and the answer after the result continues that turn."""
    t = TEMPLATES["gemma4"]
    tok = build_tokenizer(replace(t, text=(RELEASED / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8"),
                                  specials=t.specials + ("<|channel>", "<channel|>", '<|"|>', "<|think|>")))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    rec = {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Bye."}]}
    enc, spans = _encode(tok, rec)
    assert spans == ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
                     "Sunny.<turn|>\n", "Bye.<turn|>\n"]
    assert 'response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>' in tok.decode(enc.input_ids)


@pytest.mark.parametrize("train_reasoning", [False, True])
def test_data_train_reasoning_reaches_the_pipeline(tmp_path, train_reasoning):
    """data.train_reasoning through the tokenising pipeline (the one train runs, its cache keyed by the setting):
    off, the analysis channel is prompt; on, it is trained with the answer."""
    import json

    from rocktune.config import DataConfig
    from rocktune.data import dataset

    tok = _tok("gpt-oss")
    data = tmp_path / "harmony.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}, {
        "role": "assistant", "thinking": "Add them.", "content": "4"}]}) + "\n", encoding="utf-8")
    d = DataConfig(train_file=str(data), max_length=512, train_reasoning=train_reasoning)
    seen, _ = dataset.tokenize_file(str(data), d, tok, tmp_path / "cache")
    ids, labels = list(seen.input_ids[0]), list(seen.labels[0])
    trained = tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE])
    answer = "<|channel|>final<|message|>4<|return|>"
    assert trained == ("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant" + answer
                       if train_reasoning else answer)


GLM = TEMPLATES["glm4.5"]
GLM_REAL = RELEASED / "zai-org-GLM-4.6.jinja"  # GLM-4.5's template, as 4.6 ships it


def _glm(folder: Path, text: str = GLM.text, stops: tuple[str, ...] = GLM.stops):
    """A GLM-4.5 tokenizer loaded from a model folder whose generation_config.json stops on ``stops`` besides EOS
    (the released one lists <|endoftext|>, <|user|> and <|observation|>)."""
    from transformers import AutoTokenizer

    tok = build_tokenizer(replace(GLM, text=text))
    tok.save_pretrained(folder)
    ids = tok.convert_tokens_to_ids([GLM.eos, *stops])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}), encoding="utf-8")
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", [GLM.text, GLM_REAL.read_text(encoding="utf-8")], ids=["shape", "real"])
def test_glm45_multi_turn_replies_end_with_the_next_user_token(tmp_path, text):
    """Each reply is trained up to and with the <|user|> that opens the next turn; after the last reply, where the
    template writes nothing, <|user|> is appended and trained. A reply's reasoning before the last user turn is
    dropped as the template drops it; after it, kept in its think block."""
    tok = _glm(tmp_path, text)
    rec = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
                        {"role": "assistant", "reasoning_content": "old thought", "content": "one"},
                        {"role": "user", "content": "second"},
                        {"role": "assistant", "reasoning_content": "new thought", "content": " two "}]}
    enc, spans = _encode(tok, rec, appended="<|user|>")
    assert spans == ["\n<think></think>\none<|user|>", "\n<think>new thought</think>\ntwo<|user|>"]
    assert "old thought" not in tok.decode(enc.input_ids)
    assert enc.labels[-1] == tok.convert_tokens_to_ids("<|user|>")  # the appended end bears loss


@pytest.mark.parametrize("text", [GLM.text, GLM_REAL.read_text(encoding="utf-8")], ids=["shape", "real"])
def test_glm45_tool_call_ends_with_observation(tmp_path, text):
    """A tool call is trained in GLM's XML syntax up to the <|observation|> that opens its results (a stop of the
    model); consecutive results are prompt under one <|observation|>; the answer ends with the appended <|user|>.
    A conversation ending on a call gets <|observation|> appended, where the model stops to wait for the result."""
    tok = _glm(tmp_path, text)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"},
            {"role": "assistant", "content": "Sunny and warm."}]
    enc, spans = _encode(tok, {"tools": TOOLS, "messages": msgs}, appended="<|user|>")
    xml = ("\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    assert spans == [xml + "<|observation|>", "\n<think></think>\nSunny and warm.<|user|>"]
    text_all = tok.decode(enc.input_ids)
    assert text_all.count("<|observation|>") == 1 and "# Tools" in text_all and '"name": "get_weather"' in text_all
    _, spans = _encode(tok, {"tools": TOOLS, "messages": msgs[:2]}, appended="<|observation|>")
    assert spans == [xml + "<|observation|>"]


def test_glm45_chat_data_passes_the_data_checks(tmp_path):
    """The checks that refused GLM-4.5's chat data pass: the end tokens are <|user|> and <|observation|>, both
    trained, and the conversation as trained is the template's rendering plus the appended end."""
    from rocktune.data.checks import check_training_data, end_of_turn_id, stop_token_ids
    from rocktune.data.dataset import Examples

    tok = _glm(tmp_path)
    chat = to_chat({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "r", {})
    enc = encode(chat, "messages", tok, 512, False, "r")
    assert stop_token_ids(tok, "messages") == {tok.convert_tokens_to_ids(s): s for s in ("<|user|>", "<|observation|>")}
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|user|>")
    assert check_training_data(Examples([enc.input_ids], [enc.labels]), tok, "messages", False, [("r", chat)]) == []


def test_glm45_without_the_stops_is_refused_saying_why(tmp_path):
    """A model whose generation config does not stop on the role tokens (GLM's template with only EOS as stop):
    nothing after a reply is a token the model stops on, so chat data is refused before training, naming what the
    template writes next, what the model stops on and the ways out."""
    from rocktune.data.checks import check_training_data, enforce
    from rocktune.data.dataset import Examples
    from rocktune.errors import UserError

    tok = _glm(tmp_path, stops=())
    chat = to_chat({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "r", {})
    enc = encode(chat, "messages", tok, 512, False, "r")
    assert enc.input_ids == list(tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=True)[
        "input_ids"])  # nothing appended
    problems = check_training_data(Examples([enc.input_ids], [enc.labels]), tok, "messages", False)
    assert [p.code for p in problems] == ["stop-never-trained"]
    with pytest.raises(UserError) as err:
        enforce(problems, "chat.jsonl")
    said = " ".join(str(err.value).split())
    assert "end token <|endoftext|> never carries loss" in said
    assert "writes no end-of-turn token after a reply, and the token it opens the next turn with (<|user|>) is " \
           "not one the model stops on (the model stops on: <|endoftext|>" in said
    assert "generation_config.json's eos_token_id" in said and "prompt/completion" in said


def test_glm45_generation_stops_where_replies_end(tmp_path):
    """The tokens GLM-4.5's replies are trained to end with are ones generation stops on: transformers' generation
    config and rocktune generate's stops (models/load.stop_ids) hold both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rocktune.data.checks import stop_token_ids
    from rocktune.models.load import stop_ids
    from tests.family_fixtures import build_family

    path = build_family(BY_NAME["glm4.5"], tmp_path / "glm")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    ends = set(stop_token_ids(tok, "messages"))
    assert ends == {tok.convert_tokens_to_ids("<|user|>"), tok.convert_tokens_to_ids("<|observation|>")}
    assert ends <= set(model.generation_config.eos_token_id) and ends <= set(stop_ids(tok, model))


def test_the_token_cache_key_follows_the_models_stops(tmp_path):
    """The reply's end comes from generation_config.json too: a model folder whose stop list changed gets a new
    tokenizer fingerprint (tokens labelled for the old stops are not reused from the cache)."""
    from rocktune.data.cache import tokenizer_fingerprint

    with_stops = tokenizer_fingerprint(_glm(tmp_path / "a"))
    assert tokenizer_fingerprint(_glm(tmp_path / "b")) == with_stops  # same files, same key
    assert tokenizer_fingerprint(_glm(tmp_path / "c", stops=())) != with_stops
