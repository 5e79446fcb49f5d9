"""Make localserve's built-in demo model (localserve/demo/stories260K.gguf) from the
stories260K GGUF (karpathy/tinyllamas, MIT): the same tensors and metadata, plus a chat
template of our own and a name and licence. Run once by a maintainer; the output is
committed (the one model file the project carries):

    python scripts/make_demo_model.py tests/data/models/stories260K.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

TARGET = Path(__file__).resolve().parents[1] / "localserve" / "demo" / "stories260K.gguf"

# stories260K completes children's stories: a user message is the start of a story and
# the reply goes on with it (a system message, if any, leads the story).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{% if not loop.last %} {% endif %}{% endif %}"
    "{% endfor %}"
)

REPLACED = {"general.name", "general.license", "general.source.url", "tokenizer.chat_template"}


def make(source: Path, target: Path) -> None:
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in REPLACED:
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type)
    writer.add_name("localserve demo (stories260K)")
    writer.add_license("MIT")
    writer.add_source_url("https://huggingface.co/karpathy/tinyllamas")
    writer.add_chat_template(CHAT_TEMPLATE)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=list(reversed(tensor.shape.tolist())),
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("--target", type=Path, default=TARGET)
    args = parser.parse_args()
    make(args.source, args.target)
    print(f"wrote {args.target} ({args.target.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
