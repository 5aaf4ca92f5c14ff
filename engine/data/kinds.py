"""The kinds of token source Forge ships, each registered once in `SOURCE_KINDS` (engine/config/registry.py) with
its own `[data]` fields and what it does, named "module:function" so that registering imports nothing but this
module (engine/config/data.py imports it to compose `[data]`; torch-free, no `datasets`, no fsspec).

(in the order messages list them)
- `shards`: a folder written by `forge tokenize` (a path field's plain spelling);
- `remote`: such a folder behind a URL (`s3://…`, `gs://…`, `https://…`, `memory://…`), fetched once into the Forge
  cache (engine/data/remote_shards.py);
- `embedded`: a split of the Shakespeare corpus in the package, `embedded:SPLIT` (engine/data/embedded.py);
- `hf`: a Hugging Face dataset, named by `hf_dataset_name` (`hf_name` in `[[data.datasets]]`) for training, which
  tokenizes it once into the cache (engine/data/hub_cache.py), and as `hf:NAME` by `forge tokenize`
  (engine/data/hub.py); its fields are the `hf_*` fields of `[data]`.

A new kind is a class of its own fields (`Section` itself for none) decorated with `@SOURCE_KINDS.register(...)`,
here or in a module this one imports; docs/architecture.md ("A data source") lists what else it may need.
"""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section
from engine.config.registry import SOURCE_KINDS

SOURCE_KINDS.register(
    "shards", directory="engine.data.source_kinds:shards_directory", describe="a folder written by forge tokenize"
)(Section)
SOURCE_KINDS.register(
    "embedded",
    directory="engine.data.source_kinds:embedded_directory",
    describe="a split of the embedded Shakespeare corpus (embedded:SPLIT)",
    example="embedded:train",
    prefixed=True,
)(Section)


class HubDatasetFields(Section):
    """A Hugging Face dataset a section reads instead of shards (`data.hf_*` to train on, `eval.hf_*` to
    evaluate on): fields of the section itself, so the TOML and the error paths stay flat
    (`eval.hf_dataset_split`). Pydantic puts a base's fields first; a section that wants fields before these
    takes them from a base listed after this one (see engine/config/eval.py: EvalConfig)."""

    hf_dataset_name: str | None = Field(
        None,
        description="a Hugging Face dataset (Hub id or local folder) instead of dataset_path: tokenized once "
        "with data.tokenizer_path into the Forge cache, then read like shards. Also spelled hf_name, and each "
        "hf_dataset_* field hf_*",
    )
    hf_dataset_config: str | None = Field(None, description="hf_dataset_name's configuration (subset)")
    hf_dataset_split: str = Field("train", description="hf_dataset_name's split")
    hf_dataset_revision: str | None = Field(
        None, description="hf_dataset_name's Hub branch, tag or commit; a commit keeps a long run's data fixed"
    )


@SOURCE_KINDS.register(
    "hf",
    directory="engine.data.source_kinds:hub_directory",
    describe="a Hugging Face dataset input (hf:NAME)",
    example="hf:HuggingFaceFW/fineweb-edu",
    prefixed=True,
    documents="engine.data.hub:open_input",
    flags=("--hf-config", "--split", "--streaming", "--revision"),
    rule="engine.data.rules:hub_data_issues",
)
class HubSourceFields(HubDatasetFields):
    """The Hugging Face kind's fields of `[data]`: the dataset to train on and how its rows are read (the text
    column and streaming also serve `eval.hf_dataset_name` and the `hf_name` entries of `[[data.datasets]]`, so
    its own rule, engine/data/rules.py: hub_data_issues, says when they are unread). On the forge tokenize
    command line the same settings are `--hf-config`, `--split`, `--streaming` and `--revision`."""

    hf_dataset_text_field: str = Field(
        "text",
        description="the column that holds the text (also for eval.hf_dataset_name). Also spelled text_field",
    )
    hf_streaming: bool = Field(
        False,
        description="tokenize from a stream instead of downloading the dataset first (also for eval.hf_dataset_name "
        "and the hf_name entries of data.datasets)",
    )


SOURCE_KINDS.register(
    "remote",
    directory="engine.data.source_kinds:remote_directory",
    describe="forge tokenize output behind a URL (s3://, gs://, https://, memory://)",
    manifest="engine.data.source_kinds:remote_manifest",
)(Section)
