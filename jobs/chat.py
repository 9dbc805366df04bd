"""Ask the server a question with the official OpenAI client: ``python -m jobs.chat "What's deep learning?"``.

Streams the answer from ``--base-url`` (default http://127.0.0.1:8000/v1, as ``python -m jobs.serve``
serves); the model defaults to the first one the server lists. Greedy unless --temperature is given.
"""

from __future__ import annotations

import argparse
import os
import sys


DEFAULT_URL = "http://127.0.0.1:8000/v1"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.chat", description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="?", default="What's deep learning?",
                    help="the question (default: %(default)r)")
    ap.add_argument("--base-url", dest="base_url", default=DEFAULT_URL,
                    help="the server's OpenAI API base URL (default: %(default)s)")
    ap.add_argument("--api-key", dest="api_key", default=os.environ.get("DSQUANT_API_KEY", "none"),
                    help="bearer token the server requires (default: $DSQUANT_API_KEY, else 'none')")
    ap.add_argument("--model", default=None, help="model id (default: the first model the server lists)")
    ap.add_argument("--system", default=None, help="a system prompt (default: none)")
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=128,
                    help="most tokens in the answer (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature; 0 is greedy (default: %(default)s)")
    ap.add_argument("--no-stream", dest="stream", action="store_false",
                    help="wait for the whole answer instead of streaming it (default: off, streamed)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    try:
        model = args.model or client.models.list().data[0].id
        kw = dict(model=model, messages=messages, max_tokens=args.max_tokens, temperature=args.temperature)
        print(f"> {args.prompt}")
        if args.stream:
            for chunk in client.chat.completions.create(stream=True, **kw):
                if chunk.choices and chunk.choices[0].delta.content:
                    print(chunk.choices[0].delta.content, end="", flush=True)
            print()
        else:
            print(client.chat.completions.create(**kw).choices[0].message.content)
    except openai.APIConnectionError:
        print(f"error: no server at {args.base_url} (start one with: python -m jobs.serve)", file=sys.stderr)
        return 2
    except openai.APIStatusError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
