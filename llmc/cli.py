"""The `llmc` command line: build, inspect, run, eval.

Results go to stdout, logs and progress to stderr. A mistake the user can fix prints one line and
exits non-zero (2 for a bad recipe), never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import typing
from pathlib import Path

import click

import llmc
from llmc.errors import ConfigError, LlmcError, RecipeError, RequestError
from llmc.runtime.artifact import KV_CACHE_DTYPES, RuntimeDefaults
from llmc.runtime.server.reasoning_parsers import REASONING_PARSERS
from llmc.runtime.server.tool_parsers import NOT_BUILT, TOOL_CALL_PARSERS, unknown_parser

logger = logging.getLogger("llmc")


class _JsonObject(click.ParamType):
    name = "JSON"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            self.fail(f"not valid JSON ({e})", param, ctx)
        if not isinstance(parsed, dict):
            self.fail("expected a JSON object", param, ctx)
        return parsed


JSON_OBJECT = _JsonObject()


class _JsonStringList(click.ParamType):
    """A JSON list of strings, as vLLM's --allowed-origins '["https://a.example"]' takes it."""

    name = "JSON"

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return tuple(value)
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            self.fail(f"not valid JSON ({e}); give a list such as '[\"*\"]'", param, ctx)
        if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
            self.fail(f"expected a JSON list of strings such as '[\"*\"]', got {value}", param, ctx)
        return tuple(parsed)


JSON_STRING_LIST = _JsonStringList()


def _tool_call_parser(ctx, param, value: str | None) -> str | None:
    """--tool-call-parser: vLLM's names of formats llmc does not read are refused saying so."""
    if value in NOT_BUILT:
        raise click.BadParameter(unknown_parser(value), param=param)
    return value


def _structured_outputs_config(ctx, param, value: dict | None) -> bool:
    """vLLM's --structured-outputs-config JSON, of which llmc reads enable_in_reasoning (whether an output
    constraint covers the reasoning too): its value. backend may say what llmc uses (xgrammar, or auto); any
    other key or backend is refused."""
    value = value or {}
    others = sorted(set(value) - {"enable_in_reasoning", "backend"})
    if others:
        raise click.BadParameter(f"llmc reads only enable_in_reasoning (and backend) here, got {', '.join(others)}",
                                 param=param)
    if value.get("backend", "auto") not in ("auto", "xgrammar"):
        raise click.BadParameter(f"backend {value['backend']!r}: llmc's structured output is xgrammar; use xgrammar "
                                 "or auto, or drop it", param=param)
    enabled = value.get("enable_in_reasoning", False)
    if not isinstance(enabled, bool):
        raise click.BadParameter(f"enable_in_reasoning must be true or false, got {enabled!r}", param=param)
    return enabled


class _OneOrMoreOption(click.Option):
    """A `multiple` option that also takes several values after one flag, as argparse's nargs="+"
    (vLLM's `--served-model-name a b`): the values up to the next option."""

    def add_to_parser(self, parser, ctx):
        super().add_to_parser(parser, ctx)
        long_opts = getattr(parser, "_long_opt", {})  # click's parser internals (8.x)
        option = next((long_opts[name] for name in self.opts if name in long_opts), None)
        if option is None:  # another click: the flag given once per name still works
            return
        process_one = option.process

        def process(value, state):
            process_one(value, state)
            run = 0  # the values up to the next option
            while run < len(state.rargs) and not state.rargs[run].startswith("-"):
                run += 1
            if not state.largs and not _positional_after(parser, state.rargs[run:]):
                run -= 1  # ARTIFACT not given yet, nor later: the last of them is it (--served-model-name a ART)
            for _ in range(run):
                process_one(state.rargs.pop(0), state)

        option.process = process


def _positional_after(parser, rargs: list[str]) -> bool:
    """Whether a bare value (ARTIFACT) comes among `rargs`, the options' own values skipped."""
    i = 0
    while i < len(rargs):
        arg = rargs[i]
        if arg == "--":
            return i + 1 < len(rargs)
        if not arg.startswith("-"):
            return True
        option = parser._long_opt.get(arg) or parser._short_opt.get(arg)  # "--port=9": one word, no value after
        i += 2 if option is not None and option.takes_value else 1
    return False


def runtime_option_flags(fn):
    """One flag per engine option (the recipe's `runtime` names); unset flags keep the artifact's value."""
    hints = typing.get_type_hints(RuntimeDefaults)
    for f in reversed(dataclasses.fields(RuntimeDefaults)):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} [default: the artifact's value]"
        base = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) else hints[f.name]
        # vLLM's name is an option of its own, passed on by that name: both given is refused ("given twice")
        # and errors name the flag given, as LLM(...) does
        for dest in [f.name] + ([f.metadata["alias"]] if "alias" in f.metadata else []):
            names = ["--" + dest.replace("_", "-")]
            text = help_text if dest == f.name else f"vLLM's name of {flag}"
            if base is bool:
                fn = click.option(f"{names[0]}/--no-{names[0][2:]}", dest, default=None, help=text)(fn)
            elif dataclasses.is_dataclass(base):  # nested settings as JSON, e.g. --speculative '{"method": "ngram", ...}'
                fn = click.option(*names, dest, type=JSON_OBJECT, default=None, help=text + " (JSON)")(fn)
            else:
                fn = click.option(*names, dest, type=base, default=None, help=text)(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(llmc.__version__, prog_name="llmc")
@click.option("-v", "--verbose", is_flag=True, help="log debug details to stderr")
def cli(verbose: bool) -> None:
    """llmc: compile a Hugging Face checkpoint into a quantized artifact, then serve it."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="llmc: %(message)s", stream=sys.stderr, force=True
    )
    if not verbose:
        for noisy in ("httpx", "urllib3", "filelock", "transformers"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None, help="override the recipe's output directory")
@click.option("--adapter", "adapters", multiple=True, type=click.Path(),
              help="a PEFT LoRA adapter directory to merge, replacing the recipe's adapter (repeat it to merge several, in order)")
@click.option("--quiet", "-q", is_flag=True, help="no progress bars")
def build(recipe: str, output: str | None, adapters: tuple[str, ...], quiet: bool) -> None:
    """Build the artifact RECIPE describes (atomically: a failed build leaves nothing behind)."""
    from llmc.cli_report import print_build_summary
    from llmc.compiler.build import build as run_build
    from llmc.compiler.recipe import load_recipe

    parsed = load_recipe(recipe)
    if output is not None:
        parsed = dataclasses.replace(parsed, output=output)
    if adapters:
        parsed = dataclasses.replace(parsed, adapter=list(adapters))
    try:
        result = run_build(parsed, show_progress=not quiet)
    except RecipeError as e:  # found at build time (output, max_model_len, patterns): name the recipe too
        raise RecipeError(f"{recipe}: {e}") from None
    print_build_summary(result)


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print the manifest and the estimate as JSON")
@click.option("--verify", is_flag=True, help="re-hash every file and name any corrupted or missing one")
@click.option("--gpu-memory-gib", type=click.FloatRange(min=0, min_open=True, max=65536), default=None,
              callback=lambda ctx, param, value: _finite(param, value),
              help="plan the KV cache for a GPU of this size [default: the recipe's target]")
def inspect(artifact: str, as_json: bool, verify: bool, gpu_memory_gib: float | None) -> None:
    """Show what is in ARTIFACT and what it will need in memory."""
    from llmc.cli_report import inspect_report
    from llmc.runtime.artifact import read_manifest, verify_files

    manifest = read_manifest(artifact)
    problems = verify_files(artifact, manifest) if verify else []
    try:
        report = inspect_report(artifact, manifest, gpu_memory_gib)
    except LlmcError:
        if problems:  # the report reads the damaged files: name them all instead
            raise LlmcError(f"{artifact}: {len(problems)} file(s) failed verification: " + "; ".join(problems)) from None
        raise
    if verify:
        report["verify"] = {"ok": not problems, "problems": problems}
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        from llmc.cli_report import print_inspect

        print_inspect(report)
    if verify and report["verify"]["problems"]:
        raise LlmcError(f"{artifact}: {len(report['verify']['problems'])} file(s) failed verification: "
                        + "; ".join(report["verify"]["problems"]))


@cli.command()
@click.argument("artifact", type=click.Path())
@click.argument("out", type=click.Path(file_okay=False))
def export(artifact: str, out: str) -> None:
    """Write ARTIFACT as a compressed-tensors Hugging Face checkpoint in OUT (config.json, model.safetensors,
    tokenizer files): the format llm-compressor writes and vLLM loads (`vllm serve OUT`)."""
    from llmc.compiler.export import export_artifact

    result = export_artifact(artifact, out)
    click.echo(f"exported {artifact} -> {result.out_dir} ({result.format}: {len(result.quantized)} quantized linears, "
               f"{len(result.ignored)} dense in ignore, {result.num_tensors} tensors)")


def _finite(param, value: float | None) -> float | None:
    """A float option's value, refused when NaN (FloatRange lets NaN through: every comparison is false)."""
    if value is not None and value != value:
        raise click.BadParameter("nan is not a number of GiB", param=param)
    return value


@cli.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompt", "-p", default=None, help="generate one completion of this text and print it as it is generated")
@click.option("--chat", is_flag=True, help="apply the chat template (with --prompt: one user turn; alone: interactive chat)")
@click.option("--input", "input_path", type=click.Path(dir_okay=False), default=None,
              help="run this OpenAI batch file (JSONL: custom_id, method, url, body per line) offline; needs --output")
@click.option("--output", "output_path", type=click.Path(dir_okay=False), default=None,
              help="where --input writes one result line per request (JSONL, input order)")
@click.option("--host", default="127.0.0.1", help="server: address to listen on (0.0.0.0: every interface)")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, help="server: TCP port")
@click.option("--served-model-name", cls=_OneOrMoreOption, multiple=True,
              help="the model name(s) clients send, e.g. --served-model-name NAME ALIAS (responses name the one sent; "
              "logs and metrics the first) [default: the artifact directory's name]")
@click.option("--api-key", envvar="LLMC_API_KEY", default=None, help="server: require 'Authorization: Bearer KEY' on /v1 (or set LLMC_API_KEY)")
@click.option("--max-waiting", type=click.IntRange(min=0), default=1024, show_default=True,
              help="server: answer 503 (Retry-After) to a request that would leave more sequences than this waiting "
              "for a seat (n / best_of count; 400 for a request that could never fit)")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="server: seconds SIGTERM lets running requests finish before aborting them (their streams get an error event)")
@click.option("--max-tokens", type=int, default=None,
              help="tokens to generate (--prompt, --chat) [default: the model's generation config, else 256]")
@click.option("--temperature", type=float, default=None, help="0 = greedy [default: the model's generation config, else 1.0]")
@click.option("--top-p", type=float, default=None, help="nucleus sampling mass [default: the model's generation config, else 1.0]")
@click.option("--top-k", type=int, default=None,
              help="sample among the k most likely tokens (0 = all) [default: the model's generation config, else 0]")
@click.option("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
@click.option("--device", default=None, help="cuda, cuda:N or cpu [default: cuda when available]")
@click.option("--nnodes", type=click.IntRange(min=1), default=1,
              help="parallel artifacts: hosts sharing the ranks (run this command on each, with its --node-rank)")
@click.option("--node-rank", type=click.IntRange(min=0), default=0,
              help="parallel artifacts: this host's index; 0 runs the driver (server, scheduler), others only ranks")
@click.option("--master-addr", default="127.0.0.1", help="parallel artifacts: address of node 0, where ranks meet")
@click.option("--master-port", type=click.IntRange(0, 65535), default=0,
              help="parallel artifacts: port on node 0 where ranks meet [default: any free port, one host only]")
@click.option("--trust-request-chat-template", is_flag=True,
              help="server: render a chat_template sent in a request (Jinja from the client); refused by default, as in vLLM")
@click.option("--allowed-origins", type=JSON_STRING_LIST, default='["*"]',
              help="server: CORS origins browsers may call from (JSON list, as vLLM's)")
@click.option("--allowed-methods", type=JSON_STRING_LIST, default='["*"]', help="server: CORS methods (JSON list)")
@click.option("--allowed-headers", type=JSON_STRING_LIST, default='["*"]', help="server: CORS headers (JSON list)")
@click.option("--allow-credentials", is_flag=True, help="server: CORS: let browsers send cookies and credentials")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="server and batch files: tool_choice \"auto\" (the default when a request gives tools) reads tool "
              "calls out of the output with --tool-call-parser; without it such requests get a 400, as in vLLM")
@click.option("--tool-call-parser", type=click.Choice(TOOL_CALL_PARSERS + tuple(NOT_BUILT)), default=None,
              callback=_tool_call_parser,
              help="server and batch files: how tool calls are written in the model's output: hermes "
              "(<tool_call>{...}</tool_call>: Hermes, Qwen 2.5/3), llama3_json ({\"name\": ..., \"parameters\": ...}: "
              "Llama 3.1+; llama4_json the same), mistral ([TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}: Mistral), "
              "pythonic ([f(a=1), g()]: Llama 3.2, Llama 4; llama4_pythonic the same), glm45 (<tool_call>NAME<arg_key>...: GLM-4.5/4.6), glm47 "
              "(GLM-4.7), qwen3_coder (<function=NAME><parameter=...: Qwen3-Coder), deepseek_v3 "
              "(<｜tool▁calls▁begin｜>...: DeepSeek-V3/R1), deepseek_v31 (NAME<｜tool▁sep｜>{...}: DeepSeek-V3.1), "
              "minimax_m2 (<minimax:tool_call><invoke name=...: MiniMax-M2), kimi_k2 (<|tool_calls_section_begin|>...: "
              "Kimi-K2), seed_oss (<seed:tool_call><function=NAME>...: Seed-OSS), ernie45 "
              "(<tool_call>{...}</tool_call>: ERNIE 4.5), granite (<tool_call>[{...}]: Granite 3.x), olmo3 "
              "(<function_calls>f(a=1)...: OLMo 3) or "
              "openai (gpt-oss's harmony messages to functions.NAME; with --reasoning-parser openai_gptoss)")
@click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), default=None,
              help="server: chat replies carry the model's thinking (<think>...</think>) apart in reasoning / "
              "reasoning_content, the answer in content: deepseek_r1 (DeepSeek-R1 and distills, QwQ), deepseek_v3 "
              "(DeepSeek-V3.1: only with chat_template_kwargs {\"thinking\": true}), qwen3, glm45, minimax_m2 (MiniMax-M2: "
              "reasoning up to </think>), minimax_m2_append_think (all content, <think> put before it), kimi_k2 "
              "(Kimi-K2-Thinking: also ended by a tool call section), seed_oss (<seed:think>...</seed:think>: "
              "Seed-OSS), ernie45 (ERNIE 4.5 Thinking: the answer unwrapped from <response>), granite (\"Here is my "
              "thought process:\" ... \"Here is my response:\": Granite 3.2+), mistral ([THINK]...[/THINK]: "
              "Magistral) or "
              "openai_gptoss (gpt-oss's harmony analysis and final channels)")
@click.option("--structured-outputs-config", type=JSON_OBJECT, default=None,
              callback=_structured_outputs_config,
              help="server: vLLM's JSON; llmc reads '{\"enable_in_reasoning\": true}': with --reasoning-parser, "
              "structured output constrains the whole output, reasoning included (else such requests get a 400)")
@click.option("--enable-responses-store", is_flag=True, envvar="VLLM_ENABLE_RESPONSES_API_STORE",
              help="server: /v1/responses keeps the last responses in memory (store, previous_response_id, GET "
              "/v1/responses/{id}); without it store: true is accepted and nothing is kept, as in vLLM "
              "(also VLLM_ENABLE_RESPONSES_API_STORE=1)")
@click.option("--chat-template", default=None,
              help="the chat template to render messages with, in place of the artifact's: a .jinja file or the "
              "template's text (server, batch files, --chat), as vLLM's")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False), default=None,
              help="server: serve HTTPS with this PEM private key (with --ssl-certfile)")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False), default=None,
              help="server: serve HTTPS with this PEM certificate (chain) (with --ssl-keyfile)")
@click.option("--ssl-ca-certs", type=click.Path(dir_okay=False), default=None,
              help="server: CA certificates (PEM) that client certificates are checked against")
@click.option("--ssl-cert-reqs", type=click.IntRange(0, 2), default=0, show_default=True,
              help="server: client certificates: 0 not asked, 1 checked when sent, 2 required (Python's ssl.CERT_*)")
@click.option("--root-path", default="",
              help="server: the path prefix a reverse proxy serves the API under (FastAPI's root_path)")
@click.option("--uvicorn-log-level", type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]),
              default="info", show_default=True, help="server: uvicorn's log level")
@click.option("--disable-uvicorn-access-log", is_flag=True, help="server: no log line per HTTP request")
@click.option("--enable-log-requests", is_flag=True,
              help="server: log each request (id, prompt text and token ids, sampling parameters), as vLLM's")
@click.option("--disable-log-requests", is_flag=True,
              help="server: vLLM's older flag, accepted: requests are not logged unless --enable-log-requests")
@click.option("--max-log-len", type=click.IntRange(min=0), default=None,
              help="server: with --enable-log-requests, at most this many prompt characters and token ids per line")
@click.option("--tokenizer-pool-size", type=click.IntRange(min=0), default=0,
              help="server: threads that tokenize prompts and render chat templates off the event loop (0: the event loop's default thread pool)")
@click.option("--data-parallel", "--data-parallel-size", "data_parallel", type=click.IntRange(min=1), default=1,
              help="server: independent engine replicas (each with its own ranks), requests to the least loaded")
@click.option("--tensor-parallel-size", "tensor_parallel_size", type=int, default=None,
              help="vLLM's flag: set at build time here (parallel.tensor); accepted when it says the artifact's value")
@click.option("--pipeline-parallel-size", "pipeline_parallel_size", type=int, default=None,
              help="vLLM's flag: set at build time here (parallel.pipeline); accepted when it says the artifact's value")
@click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", "enable_chunked_prefill", default=None,
              help="vLLM's flag: prompts are always prefilled in chunks here (max_num_batched_tokens)")
@click.option("--dtype", "dtype", default=None,
              help="vLLM's flag: the artifact's weights' dtype is set at build time; accepted when auto or that dtype")
@click.option("--quantization", "-q", "quantization", default=None,
              help="vLLM's flag: the weights are quantized at build time (quantization.method); accepted when it names "
              "the artifact's kind (awq, gptq, *_marlin, compressed-tensors for int weights; fp8 for FP8)")
@click.option("--hf-overrides", "hf_overrides", type=JSON_OBJECT, default=None,
              help="vLLM's flag: the checkpoint's config is read at build time; set hf_overrides in the recipe")
@click.option("--trust-remote-code", "trust_remote_code", is_flag=True, default=None,
              help="vLLM's flag, accepted: an artifact never runs the checkpoint's code")
@click.option("--lora-modules", "lora_modules", cls=_OneOrMoreOption, multiple=True,
              help="vLLM's flag (server): LoRA adapters served by name, NAME=PATH or JSON {\"name\", \"path\", "
              "\"base_model_name\"} (needs --enable-lora); a request's model names one")
@runtime_option_flags
def run(artifact: str, prompt: str | None, chat: bool, input_path: str | None, output_path: str | None, host: str,
        port: int, served_model_name: tuple[str, ...], api_key: str | None, max_waiting: int, shutdown_timeout: float,
        max_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None, sampling_seed: int | None,
        device: str | None, nnodes: int, node_rank: int, master_addr: str, master_port: int, data_parallel: int,
        tokenizer_pool_size: int, trust_request_chat_template: bool, allowed_origins: tuple[str, ...],
        allowed_methods: tuple[str, ...], allowed_headers: tuple[str, ...], allow_credentials: bool,
        enable_auto_tool_choice: bool, tool_call_parser: str | None, reasoning_parser: str | None,
        structured_outputs_config: bool, enable_responses_store: bool, chat_template: str | None,
        ssl_keyfile: str | None,
        ssl_certfile: str | None, ssl_ca_certs: str | None, ssl_cert_reqs: int, root_path: str,
        uvicorn_log_level: str, disable_uvicorn_access_log: bool, enable_log_requests: bool,
        disable_log_requests: bool, max_log_len: int | None, **options) -> None:
    """Run ARTIFACT: an OpenAI-compatible HTTP server (the default), one completion (--prompt),
    an interactive chat (--chat), or a batch file (--input/--output).

    A tensor/pipeline-parallel artifact starts its ranks as processes on this host, joins the
    torchrun launch it runs in, or, with --nnodes, shares them with other hosts running the same
    command with their --node-rank."""
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    lora_module_values = options.pop("lora_modules", ())
    overrides = {k: v for k, v in options.items() if v is not None}
    launch = _launch_config(nnodes, node_rank, master_addr, master_port)
    if launch is not None and launch.node_rank > 0:
        _run_worker_node(artifact, device, overrides, launch)
        return
    served_model_name = list(served_model_name) or [_default_model_name(artifact)]
    _refuse_flags_of_other_modes("server" if prompt is None and not chat and input_path is None and output_path is None
                                 else "batch" if prompt is None and not chat else "prompt")
    if chat_template is not None:
        if prompt is not None and not chat:
            raise click.UsageError("--chat-template renders messages: it applies to the server, batch files and "
                                   "--chat; leave it out with a plain --prompt")
        from llmc.runtime.tokenizer import load_chat_template

        load_chat_template(chat_template)  # a missing file or a broken template fails before the model loads
        overrides["chat_template"] = chat_template
    if enable_auto_tool_choice and tool_call_parser is None:  # vLLM's start-up check
        raise click.UsageError("--enable-auto-tool-choice requires --tool-call-parser (one of "
                               f"{', '.join(TOOL_CALL_PARSERS)})")
    if tool_call_parser == "openai" or reasoning_parser == "openai_gptoss":
        _check_harmony(artifact, tool_call_parser, reasoning_parser)
    if data_parallel > 1 and (prompt is not None or chat or input_path is not None or launch is not None):
        raise click.UsageError("--data-parallel replicates the server's engine: use it without --prompt, --chat, "
                               "--input and --nnodes")
    lora_modules = _lora_modules(artifact, lora_module_values, overrides, served_model_name)
    if input_path is not None or output_path is not None:
        _run_batch_file(artifact, device, overrides, input_path, output_path, served_model_name, prompt, chat, launch,
                        enable_auto_tool_choice, tool_call_parser, lora_modules)
        return
    if prompt is None and not chat:
        from llmc.runtime.server.api_server import CorsPolicy, serve

        tls = _tls_config(ssl_keyfile, ssl_certfile, ssl_ca_certs, ssl_cert_reqs)
        if enable_log_requests and disable_log_requests:
            raise click.UsageError("--enable-log-requests and --disable-log-requests contradict each other: give one")
        if max_log_len is not None and not enable_log_requests:
            raise click.UsageError("--max-log-len bounds the request log: give --enable-log-requests too, or drop it")
        devices = [_replica_device(artifact, device, i) for i in range(data_parallel)]
        _check_engine_options(artifact, devices, overrides)  # before the port is bound and the model loads
        factories = [_engine_factory(artifact, device, overrides, launch) for device in devices]
        serve(factories[0] if data_parallel == 1 else factories, served_model_name, host=host, port=port,
              api_key=api_key, max_waiting=max_waiting,  # statistics lines by the clock (disable_log_stats: none)
              tokenizer_pool_size=tokenizer_pool_size, shutdown_timeout_s=shutdown_timeout,
              trust_request_chat_template=trust_request_chat_template,
              cors=CorsPolicy(allowed_origins, allowed_methods, allowed_headers, allow_credentials),
              enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
              reasoning_parser=reasoning_parser, reasoning_in_structured_output=structured_outputs_config,
              tls=tls, root_path=root_path, uvicorn_log_level=uvicorn_log_level,
              access_log=not disable_uvicorn_access_log, log_requests=enable_log_requests, max_log_len=max_log_len,
              enable_responses_store=enable_responses_store, lora_modules=lora_modules)
        return
    given = {name: value for name, value in [("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                                             ("max_tokens", max_tokens), ("seed", sampling_seed)] if value is not None}
    SamplingParams(**given)  # a bad flag fails here, before the model loads
    _check_prompt_text(prompt)
    from llmc.runtime.artifact import read_manifest

    manifest = read_manifest(Path(artifact))
    pooling = _is_pooling_run(manifest, overrides)
    if pooling:  # a pooling model's --prompt prints its output: what only generation reads is refused now
        _check_embedding_flags(prompt, given)
    # The text streams to stdout: no periodic statistics line cuts into it on a terminal (unless asked
    # for with --no-disable-log-stats); one summary line goes to stderr once the text is complete.
    overrides.setdefault("disable_log_stats", True)
    if prompt is not None and "compilation_config" not in overrides:
        # one completion: one prefill step, where the piecewise graphs' capture costs seconds (unless the
        # artifact's recipe set compilation_config itself)
        if manifest.runtime.compilation_config is None:
            overrides["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    with LLM(artifact, device=device, launch=launch, **overrides) as llm:
        if pooling:  # runner pooling: the prompt's embedding (class probabilities), as JSON
            _one_pooled(llm, prompt, chat)
            return
        # flags left out take the model's generation-config defaults (generation_config auto), as a server
        # request does; without them, 256 tokens
        params = llm.get_default_sampling_params().replace(
            **{"max_tokens": llm.engine.default_sampling_fields.get("max_tokens", 256), **given})
        if prompt is None:
            _interactive_chat(llm, params)
            return
        _one_completion(llm, prompt, chat, params)


# `llmc run`'s flags that only one mode reads: given on the command line in another mode, they are refused
# rather than ignored
_MODE_FLAGS = {
    ("server",): ("host", "port", "api_key", "max_waiting", "shutdown_timeout", "tokenizer_pool_size",
                  "trust_request_chat_template", "allowed_origins", "allowed_methods", "allowed_headers",
                  "allow_credentials", "reasoning_parser", "structured_outputs_config", "ssl_keyfile", "ssl_certfile",
                  "ssl_ca_certs", "ssl_cert_reqs", "root_path", "uvicorn_log_level", "disable_uvicorn_access_log",
                  "enable_log_requests", "disable_log_requests", "max_log_len", "enable_responses_store"),
    # a batch file's chat requests go through the server's handlers: tool_choice "auto" needs them there too
    ("server", "batch"): ("enable_auto_tool_choice", "tool_call_parser", "lora_modules"),
    ("prompt",): ("max_tokens", "temperature", "top_p", "top_k", "sampling_seed"),
}


def _refuse_flags_of_other_modes(mode: str) -> None:
    """`mode`: server, batch (--input/--output) or prompt (--prompt / --chat)."""
    from click.core import ParameterSource

    context = click.get_current_context()
    for owners, names in _MODE_FLAGS.items():
        if mode in owners:
            continue
        given = [n for n in names if context.get_parameter_source(n) is ParameterSource.COMMANDLINE]
        if given:
            where = {("server",): "the server (no --prompt, --chat or --input)",
                     ("server", "batch"): "the server and batch files (--input/--output)",
                     ("prompt",): "--prompt and --chat"}[owners]
            body = " in each request's body" if mode != "prompt" and owners == ("prompt",) else ""
            raise click.UsageError(f"--{given[0].replace('_', '-')} applies to {where} only; leave it out here"
                                   + (f" (set it{body} instead)" if body else ""))


def _lora_modules(artifact: str, values: tuple[str, ...], overrides: dict, served_model_name: list[str]) -> list:
    """--lora-modules (vLLM's): the adapters the server (or a batch file) serves by name, each read and checked
    against the artifact and --max-lora-rank here, before the port is bound and the model loads."""
    if not values:
        return []
    from llmc.runtime import artifact as art
    from llmc.runtime.lora import check_lora_artifact, read_adapter
    from llmc.runtime.options import resolve_options
    from llmc.runtime.server.lora_modules import ServedAdapters, parse_lora_modules

    manifest = art.read_manifest(artifact)
    options = resolve_options(manifest, {k: v for k, v in overrides.items() if k != "chat_template"})
    if not options.enable_lora:  # the flag, or the recipe's runtime enable_lora
        raise click.UsageError("--lora-modules serves LoRA adapters at run time: give --enable-lora too (vLLM "
                               "requires enable_lora for them)")
    try:
        modules = parse_lora_modules(values)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    taken = [m.name for m in modules if m.name in served_model_name]
    if taken:
        raise click.UsageError(f"--lora-modules: {taken[0]!r} is also a --served-model-name; give the adapter "
                               "another name")
    check_lora_artifact(manifest)
    for request in ServedAdapters(modules, served_model_name[0]).requests.values():
        try:
            read_adapter(request, manifest, options.max_lora_rank)
        except RequestError as e:  # its message names the adapter ("lora_request 'NAME': ...")
            raise click.UsageError(f"--lora-modules {request.lora_name}={request.lora_path}: "
                                   f"{str(e).split(': ', 1)[-1]}") from None
    return modules


def _tls_config(keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int):
    """The server's TLS settings (None: plain HTTP), checked before the port is bound and the model loads."""
    from click.core import ParameterSource

    from llmc.runtime.server.api_server import TlsConfig

    if keyfile is None and certfile is None:
        context = click.get_current_context()
        given = [n for n in ("ssl_ca_certs", "ssl_cert_reqs")
                 if context.get_parameter_source(n) is ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--{given[0].replace('_', '-')} configures HTTPS: give --ssl-keyfile and "
                                   "--ssl-certfile too")
        return None
    if keyfile is None or certfile is None:
        raise click.UsageError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    tls = TlsConfig(keyfile, certfile, ca_certs, cert_reqs)
    tls.check()
    return tls


def _check_prompt_text(prompt: str | None) -> None:
    """--prompt's bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes."""
    from llmc.runtime.tokenizer import is_unicode_text

    if prompt is not None and not is_unicode_text(prompt):
        raise RequestError("--prompt: not Unicode text (it holds bytes that are not UTF-8); give the text in UTF-8")


def _is_pooling_run(manifest, overrides: dict) -> bool:
    """Whether the engine these options start on this artifact pools (an embedding model, a classifier)."""
    from llmc.runtime.options import resolve_options
    from llmc.runtime.pooling import is_pooling

    options = resolve_options(manifest, {k: v for k, v in overrides.items() if k != "chat_template"})
    return is_pooling(options, manifest.model)


def _check_embedding_flags(prompt: str | None, sampling_flags: dict) -> None:
    if prompt is None:
        raise click.UsageError("--chat alone is an interactive chat, which a pooling model (an embedding model, "
                               "a classifier) cannot hold; give --prompt TEXT for its output, or serve it (no --prompt)")
    if sampling_flags:
        flag = {"seed": "sampling-seed"}.get(name := next(iter(sampling_flags)), name.replace("_", "-"))
        raise click.UsageError(f"--{flag} samples generated text; a pooling model (an embedding model, a "
                               "classifier) generates none: leave it out")


def _one_pooled(llm, prompt: str, chat: bool) -> None:
    """--prompt on a pooling model: an embedding model's embedding on stdout, one JSON array; a classifier's
    {"label", "probs"}, one JSON object (vLLM's /classify item)."""
    import json

    from llmc.runtime.pooling import top_label
    from llmc.runtime.tokenizer import apply_chat_template

    if chat:
        prompt = {"prompt_token_ids": apply_chat_template(llm.tokenizer, [{"role": "user", "content": prompt}],
                                                          add_generation_prompt=False)}
    if llm.engine.pooler.task == "embed":
        [output] = llm.embed(prompt)
        click.echo(json.dumps(output.outputs.embedding))
        return
    [output] = llm.classify(prompt)
    probs = output.outputs.probs
    click.echo(json.dumps({"label": top_label(llm.engine.manifest.model.labels, probs), "probs": probs}))


def _one_completion(llm, prompt: str, chat: bool, params) -> None:
    """--prompt: the completion on stdout as it is generated (the prompt first, without --chat)."""
    import time

    start = time.monotonic()
    messages = [{"role": "user", "content": prompt}] if chat else None
    deltas = llm.stream(prompt if not chat else None, params, messages=messages)
    if not chat:
        click.echo(prompt, nl=False)
    for delta in deltas:
        click.echo(delta, nl=False)
    click.echo()
    seconds = time.monotonic() - start
    num_tokens = llm.stats().get("num_generation_tokens")
    if num_tokens:
        logger.info("%d tokens in %.2f s (%.1f tokens/s)", num_tokens, seconds, num_tokens / seconds)


@cli.command(name="eval")
@click.argument("artifact", type=click.Path())
@click.option("--data", required=True, type=click.Path(dir_okay=False), help="text file to measure perplexity on")
@click.option("--seq-len", type=click.IntRange(min=2), default=512, help="tokens per window")
@click.option("--max-windows", type=click.IntRange(min=1), default=None, help="measure at most this many windows [default: all]")
@click.option("--compare", "compare_with", type=click.Path(), default=None,
              help="another artifact: report the mean KL divergence and top-1 agreement against it")
@click.option("--kv-cache-dtype", type=click.Choice(list(KV_CACHE_DTYPES)), default=None,
              help="ARTIFACT's KV-cache dtype (not the --compare one's) [default: the artifact's]")
@click.option("--device", default=None, help="cuda, cuda:N or cpu [default: cuda when available]")
@click.option("--json", "as_json", is_flag=True, help="print the numbers as JSON")
def eval_command(artifact: str, data: str, seq_len: int, max_windows: int | None, compare_with: str | None,
                 kv_cache_dtype: str | None, device: str | None, as_json: bool) -> None:
    """Perplexity of ARTIFACT on a text file (GPTQ-paper protocol), optionally compared with another artifact."""
    from llmc.runtime.evaluate import check_data_file, evaluate, perplexity_windows

    check_data_file(data)  # before any model loads
    # One sequence at a time: a KV cache of one window (in blocks of at least 8 tokens) is enough.
    options = {"max_model_len": seq_len, "num_kv_blocks": -(-seq_len // 8)}
    kv = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}
    engine = _eval_engine(artifact, device, seq_len, {**options, **kv})
    reference = None
    try:
        if compare_with:
            reference = _eval_engine(compare_with, device, seq_len, options)
            vocab, other = engine.manifest.model.vocab_size, reference.manifest.model.vocab_size
            if vocab != other:
                raise RequestError(f"--compare: {compare_with} has a vocabulary of {other} tokens, {artifact} one of "
                                   f"{vocab}: compare two artifacts of the same model")
        windows = perplexity_windows(engine.tokenizer, data, seq_len, max_windows, engine.manifest.model.vocab_size)
        result = {"artifact": artifact, "data": data, **evaluate(engine, windows, reference, show_progress=True)}
    finally:  # parallel artifacts: stop their worker ranks
        engine.close()
        if reference is not None:
            reference.close()
    if compare_with:
        result["reference"] = compare_with
    if kv_cache_dtype:
        result["kv_cache_dtype"] = kv_cache_dtype
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        click.echo(f"{key:<22}{value:.4f}" if isinstance(value, float) else f"{key:<22}{value}")


def _eval_engine(artifact: str, device: str | None, seq_len: int, options: dict):
    """An Engine for `llmc eval`, whose max_model_len is --seq-len: its refusal of that length names the flag."""
    from llmc.runtime.engine import Engine

    try:
        return Engine(artifact, device=device, **options)
    except ConfigError as e:
        if "max_model_len" not in str(e):
            raise
        raise ConfigError(f"--seq-len {seq_len} (eval runs with max_model_len = --seq-len): {e}") from None


def _default_model_name(artifact: str) -> str:
    return Path(artifact).resolve().name


def _launch_config(nnodes: int, node_rank: int, master_addr: str, master_port: int):
    """A LaunchConfig when the flags ask for several hosts or a fixed port; else None (this host, or
    the torchrun launch this process runs in)."""
    if nnodes == 1 and node_rank == 0 and not master_port:
        return None
    from llmc.runtime.parallel.launcher import LaunchConfig

    return LaunchConfig(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)


def _run_worker_node(artifact: str, device: str | None, overrides: dict, launch) -> None:
    from llmc.runtime.artifact import read_manifest
    from llmc.runtime.options import resolve_device, resolve_options
    from llmc.runtime.parallel.driver import run_node

    options = resolve_options(read_manifest(artifact), overrides)
    logger.info("node %d of %d: serving ranks of %s for the driver at %s:%d",
                launch.node_rank, launch.nnodes, artifact, launch.master_addr, launch.master_port)
    run_node(Path(artifact), options, resolve_device(device), launch)


def _replica_device(artifact: str, device: str | None, index: int) -> str | None:
    """Data-parallel replica `index` on GPUs takes the next GPUs: [index × ranks, (index + 1) × ranks)."""
    import torch

    if index == 0 or not (device or "cuda").startswith("cuda") or not torch.cuda.is_available():
        return device
    from llmc.runtime.artifact import read_manifest

    first = torch.device(device or "cuda").index or 0
    return f"cuda:{first + index * read_manifest(artifact).parallel.world_size}"


def _check_engine_options(artifact: str, devices: list[str | None], overrides: dict) -> None:
    """What the engine's start would refuse in the artifact's manifest, the options and the devices,
    refused before the server binds its port (the engine starts on its own thread, after)."""
    from llmc.runtime import artifact as art
    from llmc.runtime.options import resolve_device, resolve_options

    resolve_options(art.read_manifest(artifact), {k: v for k, v in overrides.items() if k != "chat_template"})
    for device in devices:
        resolve_device(device)


def _check_harmony(artifact: str, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """gpt-oss's harmony parsers (runtime/server/harmony.py): together, and on a gpt-oss artifact only."""
    from llmc.runtime import artifact as art
    from llmc.runtime.server.harmony import check_flags, check_model

    try:
        check_flags(tool_call_parser, reasoning_parser)
        check_model(art.read_manifest(artifact).model.architecture, tool_call_parser, reasoning_parser)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _engine_factory(artifact: str, device: str | None, overrides: dict, launch=None):
    """Builds the Engine where it is called: on the server's engine thread."""

    def make_engine():
        from llmc.runtime.engine import Engine

        return Engine(artifact, device=device, launch=launch, **overrides)

    return make_engine


def _run_batch_file(artifact: str, device: str | None, overrides: dict, input_path: str | None,
                    output_path: str | None, served_model_name: list[str], prompt: str | None, chat: bool,
                    launch=None, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                    lora_modules: list = ()) -> None:
    from llmc.runtime.server.batch import run_batch

    if input_path is None or output_path is None:
        raise click.UsageError("--input and --output go together: give both")
    if prompt is not None or chat:
        raise click.UsageError("--input/--output run a batch file; leave out --prompt and --chat")
    summary = run_batch(_engine_factory(artifact, device, overrides, launch), input_path, output_path,
                        served_model_name, enable_auto_tool_choice=enable_auto_tool_choice,
                        tool_call_parser=tool_call_parser, lora_modules=lora_modules)
    logger.info("%d request(s), %d failed; results in %s", summary.num_requests, summary.num_failed, summary.output_path)


def _read_turn() -> str | None:
    """One line of the user's (re-prompting on an empty one), or None at the end of input.

    NOTE: the wait for input polls stdin rather than blocking in a read: the kernel may deliver Ctrl-C's
    SIGINT to any thread of the process (torch's and the engine's too), and then a main thread blocked in
    read() never runs Python's handler, so Ctrl-C did nothing until the next line (seen under load). The
    line is read a byte at a time from the descriptor, so no later line waits unseen in a buffer."""
    import select

    fd = sys.stdin.fileno()
    while True:
        click.echo("you> ", nl=False, err=True)
        line = bytearray()
        while True:
            try:
                while not select.select([fd], [], [], 0.2)[0]:
                    pass  # each pass runs bytecode: a pending SIGINT raises KeyboardInterrupt here
            except (OSError, ValueError):  # a descriptor select cannot watch: block in the read
                pass
            byte = os.read(fd, 1)
            if byte in (b"", b"\n"):
                break
            line += byte
        if not byte and not line:
            return None
        text = line.decode(sys.stdin.encoding or "utf-8", sys.stdin.errors or "strict")
        if text.strip():
            return text


def _interactive_chat(llm, params) -> None:
    import signal

    # Ctrl-C must reach this thread's handler: a native library that blocked SIGINT in it while starting its
    # threads (and the mask a parent passed on) would leave it pending for good (a chat that ignores Ctrl-C)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    history: list[dict] = []
    click.echo("chat: type a message, or /exit to quit", err=True)
    while True:
        text = _read_turn()  # Ctrl-C raises KeyboardInterrupt: main exits 130
        if text is None:  # end of input ends the chat
            break
        if text.strip() in ("/exit", "/quit"):
            break
        history.append({"role": "user", "content": text})
        reply = []
        try:
            for delta in llm.stream(None, params, messages=history):
                click.echo(delta, nl=False)
                reply.append(delta)
        except RequestError as e:  # this turn only (too long for the context, text that cannot be tokenized)
            history.pop()
            click.echo(f"llmc: error: {e} (the turn is dropped; the conversation goes on)", err=True)
            continue
        click.echo()
        history.append({"role": "assistant", "content": "".join(reply)})


def main(argv: list[str] | None = None) -> None:
    try:
        code = cli.main(args=argv, prog_name="llmc", standalone_mode=False)
    except LlmcError as e:
        click.echo(f"llmc: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.UsageError as e:  # a bad flag or value: one line, as every other error a user can cause
        command = e.ctx.command_path if e.ctx is not None else "llmc"
        click.echo(f"llmc: error: {e.format_message()} (`{command} --help` lists the options)", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):  # Ctrl-C (click turns it into Abort): 128 + SIGINT
        click.echo("aborted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
