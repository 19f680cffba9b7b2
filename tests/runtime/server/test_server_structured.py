"""Structured output over HTTP with the openai client against a real `llmc run`: OpenAI's
response_format and vLLM's guided_* fields are honoured (outputs validate), bad ones are a 400
naming the field."""

import json
import re

import jsonschema
import openai
import pytest

MODEL = "ref-llama"  # the served name of the session server (conftest)

SCHEMA = {"type": "object", "properties": {"who": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["who", "n"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Who speaks?"}]


def test_response_format_json_schema_and_json_object(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "speaker", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, n=4, temperature=1.0, max_tokens=60,
                                           response_format=response_format)
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # strict left out is strict (vLLM compiles every schema so): no property the schema does not list
    loose = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, n=4, temperature=1.0, max_tokens=40,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "k", "schema": loose}})
    assert [json.loads(choice.message.content).keys() for choice in reply.choices] == [{"k"}] * 4
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.7, seed=1, max_tokens=80,
                                           response_format={"type": "json_object"})
    content = reply.choices[0].message.content  # a 12M model writes prose inside the strings: cut at 80
    assert content.startswith(("{\"", "{}")) and reply.choices[0].finish_reason in ("stop", "length")


def test_guided_fields_of_vllm(client):
    reply = client.completions.create(model=MODEL, prompt="ROMEO:", n=5, temperature=1.0, max_tokens=20,
                                      extra_body={"guided_choice": ["yes", "no", "my lord"]})
    assert {c.text for c in reply.choices} <= {"yes", "no", "my lord"}
    reply = client.completions.create(model=MODEL, prompt="ROMEO:", n=3, temperature=1.0, max_tokens=30,
                                      extra_body={"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{3}"})
    assert all(re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{3}", c.text) for c in reply.choices)
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=60, temperature=1.0,
                                      extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0,
                                      extra_body={"guided_grammar": 'root ::= "to be" " or not"'})
    assert reply.choices[0].text == "to be or not"


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_grammar": "root ::= \"a"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
])
def test_invalid_constraints_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param and param in info.value.body["message"]
