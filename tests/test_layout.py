"""The layout's promises (docs/design.md, layout): stages are peers over common/, and every command
the README and docs/ tell a user to type exists."""
import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("corpus", "auxiliary", "generate", "train", "finetune", "export")
PROJECT = ("common", *STAGES, "experiments", "bench", "tests")


def imported_packages(source: str) -> set[str]:
    """Top-level names of the project's packages that a module's source imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names if name.split(".")[0] in PROJECT}
    return found


def cross_imports(package: str, allowed: set[str]) -> list[str]:
    """'file imports X' for every import of a project package outside `allowed` in `package`'s files."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(imported_packages(path.read_text()) - allowed):
            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_the_import_reader_sees_every_form_of_import():
    source = "import train.data\nfrom generate.job import x\ndef f():\n    from common import io\nimport numpy\n"
    assert imported_packages(source) == {"train", "generate", "common"}


def test_common_imports_no_stage():
    assert cross_imports("common", {"common"}) == []


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_stands_on_common_alone(stage):
    """generate/ and train/ never import each other; no stage imports another, the experiments do."""
    assert cross_imports(stage, {"common", stage}) == []


def test_imports_inside_common_flow_one_way():
    """common/hf.py (the hf: bridge) and common/tokenizer.py (which opens an hf: tokenizer through it) do not
    import each other: what both need, the special and reserved ids, is common/vocab.py's."""
    def modules(path):
        found = set()
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        return found
    assert "common.tokenizer" not in modules("common/hf.py")
    assert "common.hf" in modules("common/tokenizer.py") and "common.vocab" in modules("common/hf.py")


def code_spans(text: str) -> list[str]:
    """Fenced code blocks and inline `code` of a Markdown text."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return fenced + inline


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z][\w-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), flags=re.M))


def test_every_make_target_in_the_docs_exists():
    targets, missing, named = make_targets(), [], set()
    for doc in documents():
        for code in code_spans(doc.read_text()):
            for target in re.findall(r"(?:^|[\s;&(])make\s+((?:[a-z][\w-]*\s*)+)", code, flags=re.M):
                for name in target.split():
                    named.add(name)
                    if name not in targets:
                        missing.append(f"{doc.name}: make {name}")
    assert {"train", "test", "corpus", "aux", "generate-epochs"} <= targets
    assert {"train", "test", "generate-epochs", "bench-gpu"} <= named, named  # the scan finds the docs' commands
    assert not missing, missing


def runnable(module: str) -> bool:
    """`python -m module` would run: the module exists, and a package has a __main__."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(module + ".__main__") is not None
    return True


def test_every_python_module_in_the_docs_exists():
    named, missing = set(), []
    for doc in documents():
        for code in code_spans(doc.read_text()):
            for module in re.findall(r"(?:python3?|torchrun[^\n`]*?)\s+-m\s+([A-Za-z_][\w.]*)", code):
                named.add(module)
                if not runnable(module):
                    missing.append(f"{doc.name}: -m {module}")
    assert {"generate", "train"} <= named
    assert not missing, missing


def test_a_missing_module_or_target_is_reported():
    assert not runnable("generate.nothing_here") and not runnable("common")  # common has no __main__
    assert runnable("train") and runnable("finetune.rotten_tomatoes")
    assert "no-such-target" not in make_targets()


def test_the_default_chain_imports_no_hugging_face_module():
    """transformers is an optional extra (`.[hf]`, only for an hf: aux model), tensorboard another
    (`.[tensorboard]`): importing every stage of the default chain must import none of them (nor tokenizers /
    safetensors)."""
    import subprocess
    import sys
    code = ("import sys, corpus.build, auxiliary.mlm, generate.generator, generate.job, train.trainer, "
            "common.corrupt, common.checkpoint, common.tokenizer, finetune.finetuner; "
            "print(sorted(m for m in ('transformers', 'tokenizers', 'safetensors', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_readme_shows_what_the_last_fresh_make_train_printed():
    """The README's example summary is the one recorded from the last fresh-clone `make train`
    (bench/results/make-train.json, written by `python -m bench.record_train`), printed the way the
    trainer prints it, with that run's date and wall time beside it; and it was made with the tiny
    preset as it is now, so changing the preset without re-running the demo fails here."""
    import hashlib
    import json
    from train.trainer import summary_text
    runs = json.loads((ROOT / "bench" / "results" / "make-train.json").read_text())["runs"]
    last, readme = runs[-1], (ROOT / "README.md").read_text()
    assert summary_text(last["summary"]) in readme
    assert last["date"] in readme and f"real {last['real']}" in readme
    assert hashlib.sha256((ROOT / last["manifest"]).read_bytes()).hexdigest() == last["manifest_sha256"], \
        f"{last['manifest']} changed since the recorded run: re-run `time make train` on a fresh clone and record it"
