"""Issue 33's target, tested: through the real ``openai`` client, an untrained model's reply under
every one of 36 JSON schemas (``response_format`` ``json_schema``, strict, sampled at temperature
1 with a fixed seed) finishes with reason ``"stop"``, parses and validates (``jsonschema``).

The schemas are the kinds applications send: nested objects, arrays with item bounds, arrays of
objects, enums and consts, integers and numbers with inclusive and exclusive bounds, string
patterns and formats, required and optional keys, closed objects, ``anyOf`` / ``oneOf``,
nullable types, ``$ref`` / ``$defs`` (recursion included) and tuples (``prefixItems``). Strings
and open-ended arrays carry a ``maxLength`` / ``maxItems``: an untrained model's text inside an
unbounded string ends only when it happens to draw the closing quote. The requests go at once
(a thread pool), so the engine decodes them side by side as a server would.
"""

from __future__ import annotations

import concurrent.futures
import json

import jax
import jsonschema
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, Served, write_byte_tokenizer

from transformer_jax.model.transformer import init_params

pytestmark = pytest.mark.usefixtures("fast_engine_compiles")

CONFIG = TINY.replace(vocab_size=320, max_seq_len=256)
MAX_TOKENS = 224
# Formats jsonschema checks without extra packages (date, email, ipv4, uuid, ...; not time).
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _obj(properties: dict, required: list[str] | None = None, **more: object) -> dict:
    """A closed object schema; every key required unless ``required`` says otherwise."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **more}


def _str(n: int = 8, **more: object) -> dict:
    return {"type": "string", "maxLength": n, **more}


ADDRESS = _obj({"street": _str(10), "city": _str(8), "zip": _str(pattern=r"^[0-9]{5}$")},
               required=["city", "zip"])
SCHEMAS: dict[str, dict] = {
    "flat_required": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                           "name": _str(6), "active": {"type": "boolean"}}),
    "optional_keys": _obj({"title": _str(8), "subtitle": _str(8), "pages": {
        "type": "integer", "minimum": 1, "maximum": 500}}, required=["title"]),
    "nested_address": _obj({"name": _str(6), "address": ADDRESS}),
    "deeply_nested": _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    "enum_strings": _obj({"status": {"enum": ["pending", "shipped", "delivered", "lost"]}}),
    "enum_mixed": _obj({"v": {"enum": [1, "two", 3.5, True, None]}}),
    "const_fields": _obj({"version": {"const": 2}, "kind": {"const": "invoice"},
                          "total": {"type": "integer", "minimum": 0, "maximum": 9}}),
    "integer_bounds": _obj({"age": {"type": "integer", "minimum": 18, "maximum": 65},
                            "score": {"type": "integer", "minimum": -10, "maximum": -1}}),
    "exclusive_bounds": _obj({"p": {"type": "number", "exclusiveMinimum": 0,
                                    "exclusiveMaximum": 1},
                              "n": {"type": "integer", "exclusiveMinimum": 5,
                                    "exclusiveMaximum": 9}}),
    "number_range": _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                          "lon": {"type": "number", "minimum": -180, "maximum": 180}}),
    "string_pattern": _obj({"code": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{2}$"},
                            "hex": {"type": "string", "pattern": r"^#[0-9a-f]{6}$"}}),
    "string_lengths": _obj({"pin": {"type": "string", "minLength": 4, "maxLength": 4},
                            "nick": {"type": "string", "minLength": 2, "maxLength": 5}}),
    "formats": _obj({"day": {"type": "string", "format": "date"},
                     "id": {"type": "string", "format": "uuid"},
                     "host": {"type": "string", "format": "ipv4"}}),
    "array_bounds": _obj({"tags": {"type": "array", "minItems": 2, "maxItems": 4,
                                   "items": _str(4)}}),
    "array_of_enums": _obj({"days": {"type": "array", "minItems": 1, "maxItems": 5,
                                     "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}}}),
    "array_of_objects": _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": _obj({"sku": _str(5), "qty": {
                                            "type": "integer", "minimum": 1,
                                            "maximum": 20}})}}),
    "nested_arrays": _obj({"grid": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    "tuple_prefix_items": _obj({"point": {"type": "array", "prefixItems": [
        {"type": "number", "minimum": 0, "maximum": 10}, {"type": "number", "minimum": 0,
                                                          "maximum": 10}, _str(4)],
        "items": False}}),
    "top_level_array": {"type": "array", "minItems": 1, "maxItems": 4,
                        "items": {"type": "integer", "minimum": 0, "maximum": 100}},
    "top_level_enum": {"enum": ["red", "green", "blue"]},
    "nullable_type_list": _obj({"middle_name": {"type": ["string", "null"], "maxLength": 6},
                                "age": {"type": ["integer", "null"], "minimum": 0,
                                        "maximum": 120}}),
    "nullable_anyof": _obj({"parent": {"anyOf": [_obj({"id": {
        "type": "integer", "minimum": 0, "maximum": 99}}), {"type": "null"}]}}),
    "any_of_shapes": _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0,
                                                 "maximum": 5}}),
        _obj({"kind": {"const": "rect"}, "w": {"type": "integer", "minimum": 1, "maximum": 9},
              "h": {"type": "integer", "minimum": 1, "maximum": 9}})]}}),
    "one_of_payment": _obj({"payment": {"oneOf": [
        _obj({"method": {"const": "card"}, "last4": _str(pattern=r"^[0-9]{4}$")}),
        _obj({"method": {"const": "iban"}, "country": {"enum": ["DE", "FR", "NL"]}})]}}),
    "defs_and_refs": {"$defs": {"person": _obj({"name": _str(6), "born": {
        "type": "integer", "minimum": 1900, "maximum": 2024}})},
        **_obj({"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}},
               required=["author"])},
    "recursive_tree": {"$defs": {"node": _obj({"v": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                                               "kids": {"type": "array", "maxItems": 2,
                                                        "items": {"$ref": "#/$defs/node"}}},
                                              required=["v"])},
                       "$ref": "#/$defs/node"},
    "booleans": _obj({"a": {"type": "boolean"}, "b": {"type": "boolean"},
                      "c": {"type": "boolean"}}),
    "null_field": _obj({"deleted_at": {"type": "null"}, "ok": {"const": True}}),
    "open_object": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                            "maximum": 9}},
                    "required": ["id"], "maxProperties": 3,
                    "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}},
    "pattern_properties_none": {"type": "object", "additionalProperties": False,
                                "properties": {}},
    "all_of_merge": {"allOf": [_obj({"a": {"type": "integer", "minimum": 0, "maximum": 5},
                                     "b": _str(3)}, required=["a"]),
                               {"required": ["a", "b"]}]},
    "calendar_event": _obj({"title": _str(10), "start": {"type": "string", "format": "time"},
                            "attendees": {"type": "array", "maxItems": 3, "items": _obj({
                                "email": {"type": "string", "format": "email",
                                          "maxLength": 20},
                                "rsvp": {"enum": ["yes", "no", "maybe"]}},
                                required=["email"])},
                            "recurring": {"type": "boolean"}}, required=["title", "start"]),
    "product_catalogue": _obj({"products": {"type": "array", "minItems": 1, "maxItems": 2,
                                            "items": _obj({
                                                "name": _str(6),
                                                "price": {"type": "number", "minimum": 0,
                                                          "exclusiveMaximum": 1000},
                                                "currency": {"enum": ["EUR", "USD"]},
                                                "stock": {"type": ["integer", "null"],
                                                          "minimum": 0, "maximum": 99}},
                                                required=["name", "price"])}}),
    "classification": _obj({"label": {"enum": ["spam", "ham"]},
                            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                            "reasons": {"type": "array", "maxItems": 2, "items": _str(8)}},
                           required=["label", "confidence"]),
    "tool_arguments": _obj({"location": _str(10), "unit": {"enum": ["celsius", "fahrenheit"]},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                           required=["location"]),
    "multiple_of": _obj({"step": {"type": "integer", "multipleOf": 5, "minimum": 0,
                                  "maximum": 50}}),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformer_jax import hf
    from transformer_jax.cli import serve as cli
    from transformer_jax.serve.app import create_app

    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)
    params = init(CONFIG, jax.random.key(3))
    path = tmp_path_factory.mktemp("ckpt") / "tiny-schemas"
    hf.save(CONFIG, jax.tree.map(np.asarray, params), path)
    write_byte_tokenizer(path)
    args = cli.build_parser().parse_args([
        "--checkpoint", str(path), "--slots", "16", "--page-size", "16", "--token-budget", "64",
        "--min-context", "256", "--compilation-cache", "",  # one width of step shapes
        "--prefill-rows", "4"])  # replies under grammars whose prompts prefill together
    runner, info, _ = cli.build(args)
    runner.start()
    runner.ready = True
    served = Served(create_app(runner, info))
    yield served, runner
    served.close()
    runner.stop()


def test_the_suite_has_at_least_30_valid_schemas():
    assert len(SCHEMAS) >= 30
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_json_schema_reply_parses_and_validates_through_the_openai_client(server):
    import openai

    served, runner = server
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)

    def ask(item: tuple[int, str, dict]) -> tuple[str, str, str]:
        seed, name, schema = item
        reply = client.chat.completions.create(
            model="tiny-schemas", messages=[{"role": "user", "content": f"{name}?"}],
            temperature=1.0, seed=seed, max_completion_tokens=MAX_TOKENS,
            response_format={"type": "json_schema",
                             "json_schema": {"name": name, "schema": schema, "strict": True}})
        choice = reply.choices[0]
        return name, choice.finish_reason, choice.message.content

    items = [(i, name, schema) for i, (name, schema) in enumerate(SCHEMAS.items())]
    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        replies = list(pool.map(ask, items))
    failures = []
    for name, finish, text in replies:
        try:
            assert finish == "stop", f"finish_reason {finish!r}"
            jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=FORMATS)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name}: {str(e).splitlines()[0]} in {text!r:.200}")
    assert not failures, "\n".join(failures)
    runner.engine.check_no_leaks()
