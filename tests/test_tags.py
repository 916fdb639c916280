"""One tag rule: every code line that a step adds or changes relative to the step it is written from
carries the step's tag inline (`# [04]`), and no other line carries it, so that
`grep '\\[04\\]' 04_cifar10_ddp.py` prints the whole lesson. Docstrings and comment-only lines carry no
tag; lines that a step keeps from its base keep their tags (`# [02]` in 04)."""

import ast
import difflib
import io
import re
import tokenize

import pytest
from launch import BASES, ROOT, SCRIPTS

TAG = re.compile(r"\[(\d\d)\]")

# Calls that are each step's lesson: `grep` of the step's tag must print them.
LESSONS = {
    "02": ["torch.device(", "torch.autocast(", "GradScaler(", "scaler.scale(loss).backward()"],
    "03": ["nn.DataParallel(", "model.module.state_dict()"],
    "04": ['for key in ("LOCAL_RANK", "WORLD_SIZE")', "torch.cuda.set_device(",
           "dist.init_process_group(", "DistributedSampler(", "DistributedDataParallel(",
           "dist.all_reduce(", "if context.rank == 0:", "dist.destroy_process_group()"],
    "05": ["deepspeed.initialize(", "model.backward(", "model.step()", "model.save_checkpoint(",
           "model.load_checkpoint(", "get_fp32_state_dict_from_zero_checkpoint("],
    "06": ["Accelerator(", "accelerator.prepare(", "accelerator.backward(", "gather_for_metrics(",
           "accelerator.save_state(", "accelerator.load_state(", "train_loader.set_epoch("],
    "07": ["MixedPrecisionPolicy(", "fully_shard(", "get_model_state_dict(", "dcp.save(",
           "dcp.load(", "set_state_dict("],
    "08": ["init_device_mesh(", "models.pipeline_stage(", "PipelineStage(", "SCHEDULES[args.schedule](",
           "schedule.step(", "distributed.average_gradients(", "schedule.eval(", "distributed.gather_weights(",
           "dcp.save(", "dcp.load("],
    "09": ["init_device_mesh(", 'add_cifar10_arguments(parser, model="vit")', "ColwiseParallel(", "RowwiseParallel(",
           "SequenceParallel(", "PrepareModuleInput(", "parallelize_module(", "fully_shard(block, mesh=",
           "loss_parallel()", ".full_tensor()"],
    "10": ["init_device_mesh(", "context_parallel_layout(", "keep_own_tokens(", "funcol.all_gather_single(",
           "register_forward_hook(all_tokens)", "register_forward_pre_hook(", "fully_shard(block, mesh=everyone"],
    "11": ["init_device_mesh(", "expert_parallel_layout(", "distribute_tensor(", "funcol.all_to_all_single(",
           "funcol.all_to_all_single_autograd(", "distribute_module(", "fully_shard(block.mlp.experts",
           "set_all_reduce_hook(", "dist.all_reduce(counts)", "balance_loss("],
}


def ancestors(step):
    found = []
    while step in BASES:
        step = BASES[step]
        found.append(step)
    return found


def comment_only_lines(source):
    return {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT and not token.line[:token.start[1]].strip()}


def code_lines(step):
    """[(line number, text)] of the script's code lines: not blank, not only a comment, not a docstring."""
    source = (ROOT / SCRIPTS[step]).read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef) and ast.get_docstring(node) is not None:
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    skipped = docstrings | comment_only_lines(source)
    return [(number, line) for number, line in enumerate(source.splitlines(), start=1)
            if line.strip() and number not in skipped]


def without_tag(line, step):
    """The line without the step's own tag: what it would be had the step not marked it."""
    return re.sub(rf"  # \[{step}\]$", "", line).replace(f"# [{step}] ", "# ")


def new_lines(step):
    """Line numbers of the step's code lines that its base does not have (new, or changed)."""
    base = [line for _, line in code_lines(BASES[step])]
    lines = code_lines(step)
    matcher = difflib.SequenceMatcher(None, base, [without_tag(line, step) for _, line in lines], autojunk=False)
    return {lines[j][0] for tag, _, _, j1, j2 in matcher.get_opcodes() if tag != "equal" for j in range(j1, j2)}


@pytest.mark.parametrize("step", BASES)
def test_every_new_line_and_only_a_new_line_carries_the_steps_tag(step):
    new = new_lines(step)
    lines = dict(code_lines(step))
    untagged = [f"{number}: {lines[number]}" for number in sorted(new) if f"[{step}]" not in lines[number]]
    not_new = [f"{number}: {line}" for number, line in lines.items() if f"[{step}]" in line and number not in new]
    assert not untagged, "new or changed, without its tag:\n" + "\n".join(untagged)
    assert not not_new, "tagged, but the same in the base:\n" + "\n".join(not_new)


@pytest.mark.parametrize("step", SCRIPTS)
def test_tags_sit_on_code_lines_and_name_the_step_or_its_ancestors(step):
    source = (ROOT / SCRIPTS[step]).read_text()
    lines = source.splitlines()
    misplaced = [f"{number}: {lines[number - 1]}" for number in sorted(comment_only_lines(source))
                 if TAG.search(lines[number - 1])]
    assert not misplaced, "a tag on a comment of its own, not on the code line:\n" + "\n".join(misplaced)
    code = dict(code_lines(step))
    allowed = {step, *ancestors(step)}
    foreign = [f"{number}: {line}" for number, line in code.items()
               if any(tag not in allowed for tag in TAG.findall(line))]
    assert not foreign, f"a tag of a step that {SCRIPTS[step]} is not written from:\n" + "\n".join(foreign)


@pytest.mark.parametrize("step", LESSONS)
def test_grep_for_the_tag_prints_the_lesson(step):
    tagged = "\n".join(line for line in (ROOT / SCRIPTS[step]).read_text().splitlines() if f"[{step}]" in line)
    missing = [call for call in LESSONS[step] if call not in tagged]
    assert not missing, f"grep '\\[{step}\\]' {SCRIPTS[step]} misses {missing}"


# One skeleton (README, "The tour"): these functions in this order in every step, so that a diff of two steps
# lands in the same places; a step may add its own between them.
SKELETON = ["parse_args", "main", "setup", "build_data", "build_model", "train_one_epoch", "evaluate",
            "save_checkpoint", "load_checkpoint"]
MAIN_LINES, TRAIN_PARAMETERS, LINE_LENGTH = 60, 5, 100


@pytest.mark.parametrize("step", SCRIPTS)
def test_every_step_has_the_skeleton_a_main_that_fits_a_screen_and_short_lines(step):
    source = (ROOT / SCRIPTS[step]).read_text()
    functions = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    assert [name for name in functions if name in SKELETON] == SKELETON
    main = functions["main"]
    assert main.end_lineno - main.lineno + 1 <= MAIN_LINES, f"main() is {main.end_lineno - main.lineno + 1} lines"
    assert len(functions["train_one_epoch"].args.args) <= TRAIN_PARAMETERS
    long = [number for number, line in enumerate(source.splitlines(), 1) if len(line) > LINE_LENGTH]
    assert not long, f"lines longer than {LINE_LENGTH} characters: {long}"
