"""Chat with a transformers model whose conversation KV lives in kvtier: each turn restores
the earlier turns from the cache and prefills only the new message.

    .venv/bin/python examples/hf_chat.py                       # a random tiny Llama, byte tokens
    .venv/bin/python examples/hf_chat.py --model Qwen/Qwen2.5-0.5B-Instruct
    printf 'hello\\nand again\\n' | .venv/bin/python examples/hf_chat.py   # non-interactive

Needs a daemon (README quick start); --socket, else $KVTIER_SOCKET, else /tmp/kvtier/kvtier.sock.
"""
import argparse
import os

import torch
from kvtier_client import KVTierClient
from kvtier_client.integrations.hf import HFPrefixCache
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--socket", default=os.environ.get("KVTIER_SOCKET", "/tmp/kvtier/kvtier.sock"))
parser.add_argument("--model", help="Hugging Face model name (default: a random tiny Llama with byte tokens)")
parser.add_argument("--max-new-tokens", type=int, default=24)
args = parser.parse_args()

if args.model:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    encode, decode = (lambda text: tokenizer.encode(text, add_special_tokens=False)), tokenizer.decode
else:  # no download: random weights, one token per UTF-8 byte (the replies are noise)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)).eval()
    encode = lambda text: list(text.encode())  # noqa: E731
    decode = lambda ids: "".join(chr(b) if 32 <= b < 127 else "." for b in ids)  # noqa: E731

with KVTierClient(f"unix://{os.path.abspath(args.socket)}", token=os.environ.get("KVTIER_TOKEN")) as kv:
    chat = HFPrefixCache(kv, model, salt=os.environ.get("USER", "me"))  # salt: one per tenant
    conversation = encode("A conversation with a helpful assistant.\n")
    while True:
        try:
            message = input("you> ")
        except EOFError:
            break
        conversation += encode(f"User: {message}\nAssistant:")
        out = chat.generate(conversation, max_new_tokens=args.max_new_tokens, do_sample=False,
                            pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0)
        print("bot>", decode(out.new_tokens).strip())
        tiers = ", ".join(sorted({t.label for t in out.restored.tiers})) or "-"
        print(f"     [kvtier: {out.restored.tokens} of {out.prompt_tokens} prompt tokens restored ({tiers}), "
              f"{out.stored.stored_blocks} new blocks stored]")
        conversation = out.sequences[0].tolist() + encode("\n")
