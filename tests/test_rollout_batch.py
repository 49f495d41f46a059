"""Dynamic sampling's batch arithmetic: which groups teach something, and merging groups from several rounds."""

import pytest
import torch

from pipeline.stages.rollout_batch import concat_batches, informative_groups, select_groups


def batch(prompt_lengths, completion_lengths, advantages, pad=0, first_id=1):
    """A TRL-layout batch: prompts left-padded, completions right-padded, one row per completion."""
    P, C = max(prompt_lengths), max(completion_lengths)
    rows = len(prompt_lengths)
    out = {"prompt_ids": torch.full((rows, P), pad), "prompt_mask": torch.zeros(rows, P, dtype=torch.long),
           "completion_ids": torch.full((rows, C), pad), "completion_mask": torch.zeros(rows, C, dtype=torch.long),
           "sampling_per_token_logps": torch.zeros(rows, C), "advantages": torch.tensor(advantages),
           "num_items_in_batch": torch.tensor(float(sum(completion_lengths)))}
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        out["prompt_ids"][i, P - p:] = torch.arange(first_id, first_id + p)
        out["prompt_mask"][i, P - p:] = 1
        out["completion_ids"][i, :c] = torch.arange(first_id, first_id + c)
        out["completion_mask"][i, :c] = 1
        out["sampling_per_token_logps"][i, :c] = -0.5
    return out


def test_accuracy_decides_which_groups_are_informative():
    """All wrong with different overlong penalties still has non-zero advantages; it teaches nothing."""
    advantages = torch.tensor([0.7, -0.7, 0.0, 0.0, 0.3, -0.3])  # group 0 varies only through the penalty
    accuracy = [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert informative_groups(accuracy, advantages, 2).tolist() == [False, False, True]
    assert informative_groups(None, advantages, 2).tolist() == [True, False, True]
    # None: a row left unscored (truncated under mask_truncated_completions); one scored row cannot vary
    assert informative_groups([None, 1.0, 0.0, 0.0, 1.0, 1.0], advantages, 2).tolist() == [False, False, False]
    assert informative_groups([None, 1.0, 0.0, None, 1.0, 1.0], advantages, 3).tolist() == [True, False]


def test_groups_from_two_rounds_merge_with_prompts_left_and_completions_right_padded():
    a = batch([2, 2, 3, 3], [4, 1, 2, 2], [1.0, -1.0, 0.5, -0.5])
    b = batch([5, 5], [6, 3], [2.0, -2.0], first_id=10)
    picked = select_groups(a, torch.tensor([1]), 2)
    assert picked["advantages"].tolist() == [0.5, -0.5] and picked["num_items_in_batch"] is a["num_items_in_batch"]
    merged = concat_batches([picked, b], pad_token_id=0)
    assert merged["prompt_ids"].shape == (4, 5) and merged["completion_ids"].shape == (4, 6)
    assert merged["prompt_ids"][0].tolist() == [0, 0, 1, 2, 3] and merged["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1]
    assert merged["completion_ids"][0].tolist() == [1, 2, 0, 0, 0, 0]
    assert merged["completion_mask"].sum(1).tolist() == [2, 2, 6, 3]
    assert merged["sampling_per_token_logps"][0].tolist() == [-0.5, -0.5, 0, 0, 0, 0]
    assert merged["advantages"].tolist() == [0.5, -0.5, 2.0, -2.0]
    # every real token keeps its position relative to the end of its prompt and the start of its completion
    for row, source in [(2, b["completion_ids"][0]), (3, b["completion_ids"][1])]:
        assert merged["completion_ids"][row].tolist() == source.tolist()


def test_engine_correction_truncates_or_masks_per_token():
    from pipeline.stages.rollout_batch import engine_correction

    ratio = torch.tensor([[1.0, 3.0, 0.25, 1.5], [0.9, 1.1, 5.0, 1.0]])
    engine = torch.full_like(ratio, -2.0)
    trainer = engine + ratio.log()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # the 5.0 is padding: never counted
    weights, stats = engine_correction(trainer, engine, mask, "token_truncate", cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 0.25, 1.5], [0.9, 1.1, 0.0, 0.0]]))
    assert stats["corrected_fraction"].item() == pytest.approx(1 / 6)
    assert stats["ratio/max"].item() == pytest.approx(3.0) and stats["ratio/min"].item() == pytest.approx(0.25)
    weights, stats = engine_correction(trainer, engine, mask, "token_mask", cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 0.0, 0.0, 1.5], [0.9, 1.1, 0.0, 0.0]]))
    assert stats["corrected_fraction"].item() == pytest.approx(2 / 6)
    engine[0, 0] = float("nan")  # a token the engine could not score is left uncorrected
    assert engine_correction(trainer, engine, mask, "token_mask", 2.0)[0][0, 0] == 1.0
    with pytest.raises(ValueError, match="sequence_mask"):
        engine_correction(trainer, engine, mask, "sequence_mask", 2.0)


class FixedCompletions:
    """The engine fleet's interface (``generate``, ``update_weights``) answering with given completions (token ids;
    EOS-ended or cut at the length limit), so each group's rewards are known: request after request takes the next
    group of ``groups`` (cycling). Keeps the sampling parameters it was asked with."""

    def __init__(self, groups: list[list[list[int]]]):
        self.groups, self.served, self.params = groups, 0, []

    def update_weights(self, state_dict):
        pass

    def generate(self, prompt_ids, params):
        from pipeline.rollout import CompletionOutput, RequestOutput

        outputs = []
        for ids, p in zip(prompt_ids, params):
            group = self.groups[self.served % len(self.groups)]
            self.served += 1
            self.params.append(p)
            outputs.append(RequestOutput(str(self.served), None, ids, [
                CompletionOutput(j, "", list(c), [-1.0] * len(c), None) for j, c in enumerate(group[:p.n])]))
        return outputs


def grpo_trainer(tmp_path, groups: list[list[str]], overrides, prompts: int = 1):
    from datasets import Dataset

    from pipeline.metrics import Timer
    from pipeline.models import TRAINING_DTYPE, load_model, resolve_device
    from pipeline.recipe import load_recipe
    from pipeline.stages.grpo import SSEGRPOTrainer, build_rewards, grpo_config
    from rewards import MathVerifier

    recipe = load_recipe("demo", [f"grpo.prompts_per_batch={prompts}", "grpo.num_generations=8", *overrides])
    model, tokenizer = load_model(recipe.model, None, seed=0, dtype=TRAINING_DTYPE)
    funcs, weights = build_rewards(recipe, Timer(), MathVerifier(),
                                   {tokenizer.eos_token_id, tokenizer.pad_token_id})
    args = grpo_config(recipe, tmp_path, resolve_device("cpu"))
    args.reward_weights = weights
    limit = recipe.grpo.max_completion_length

    def tokens(text):  # "..." at the end: cut at the length limit; else finished with EOS
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return (ids * limit)[:limit] if text.endswith("...") else ids + [tokenizer.eos_token_id]

    data = Dataset.from_list([{"prompt": f"What is 1+{i}?", "answer": str(1 + i)} for i in range(1, 3)])
    trainer = SSEGRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=data,
                             processing_class=tokenizer, fleet=FixedCompletions([[tokens(t) for t in g] for g in groups]))
    return trainer, [data[i] for i in range(prompts) for _ in range(8)]


def test_truncated_rows_stay_out_of_the_group_statistics(tmp_path, caplog):
    """Truncated completions masked (DAPO's overlong filtering, the accuracy reward alone): a group of 8 with 1 right,
    3 wrong and 4 cut at the length limit. The truncated rows get advantage 0 and the advantages of the rows in the
    loss sum to zero; scored while out of the loss, the cut rows set the group's baseline and the advantages left in
    the loss no longer summed to zero. TRL's warning about rows without a reward (a whole prompt and completion per
    batch) stays out of the log."""
    right, wrong, cut = "So \\boxed{2}", "So \\boxed{4}", "so so so ..."
    trainer, inputs = grpo_trainer(tmp_path, [[right, wrong, wrong, wrong, cut, cut, cut, cut]], [
        "grpo.mask_truncated_completions=true", "grpo.rewards.format=0.0", "grpo.dynamic_sampling=false",
        "grpo.importance_sampling=none", "grpo.max_completion_length=16"])
    with caplog.at_level("WARNING"):
        batch = trainer._generate_and_score_completions(inputs)
    assert not [r for r in caplog.records if "returned None" in r.getMessage()]
    advantages, in_loss = batch["advantages"], batch["completion_mask"].sum(1) > 0
    assert in_loss.tolist() == [True] * 4 + [False] * 4
    assert advantages[4:].abs().max() == 0
    assert abs(float(advantages[in_loss].sum())) < 1e-5
    assert advantages[0] > 0 and (advantages[1:4] < 0).all()


def test_a_cut_completion_under_the_overlong_penalty_ranks_below_a_wrong_one_and_is_trained_on(tmp_path):
    """The recipes' setting (overlong penalty on, truncated completions scored): in a group of 1 right, 3 wrong and
    4 cut, every cut row is in the loss with the lowest advantage. Masked, as the smollm2 recipes once had them, a
    cut row had advantage 0, above a wrong answer that ended late, so running past the limit escaped the penalty
    (the recipe now refuses that combination)."""
    right, wrong, cut = "So \\boxed{2}", "So \\boxed{4}", "so so so ..."
    trainer, inputs = grpo_trainer(tmp_path, [[right, wrong, wrong, wrong, cut, cut, cut, cut]], [
        "grpo.mask_truncated_completions=false", "grpo.rewards.overlong=1.0", "grpo.rewards.overlong_cache=8",
        "grpo.rewards.format=0.0", "grpo.dynamic_sampling=false", "grpo.importance_sampling=none",
        "grpo.max_completion_length=16"])
    batch = trainer._generate_and_score_completions(inputs)
    advantages, in_loss = batch["advantages"], batch["completion_mask"].sum(1) > 0
    assert in_loss.all()
    assert advantages[0] > advantages[1:4].max() and advantages[1:4].min() > advantages[4:].max()
    assert abs(float(advantages.sum())) < 1e-5


def test_data_parallel_workers_sample_with_their_own_seeds(tmp_path, monkeypatch):
    """The same prompt on worker 0 and worker 1 of a generation batch: different seeds (they drew the same random
    numbers for their i-th group before), the seeds worker 0 would give the batch's later groups."""
    from accelerate import Accelerator

    trainer, inputs = grpo_trainer(tmp_path, [["So \\boxed{3}"] * 8], ["grpo.dynamic_sampling=false"])
    seeds = []
    for rank in (0, 1):
        monkeypatch.setattr(Accelerator, "process_index", property(lambda self, rank=rank: rank))
        trainer.rollout([inputs[0]["prompt"]] * 8)
        seeds.append(trainer.fleet.params[-1].seed)
    assert seeds[0] != seeds[1]
    monkeypatch.setattr(Accelerator, "process_index", property(lambda self: 0))
    trainer.rollout([inputs[0]["prompt"]] * 8 + ["another prompt"] * 8)
    assert trainer.fleet.params[-1].seed == seeds[1]  # worker 1's group 0 is the batch's group 1


def test_dynamic_sampling_counts_surplus_informative_groups_as_dropped(tmp_path):
    """Two prompts a batch: round 1 gives one informative group and one all wrong, round 2 two informative ones. The
    batch keeps two, so two of the four sampled groups are dropped (the all-wrong one and a surplus informative one;
    the surplus was not counted before)."""
    right, wrong = "So \\boxed{2}", "So \\boxed{9}"
    mixed, all_wrong = [right] * 4 + [wrong] * 4, [wrong] * 8
    trainer, inputs = grpo_trainer(tmp_path, [mixed, all_wrong, mixed, mixed],
                                   ["grpo.rewards.format=0.0", "grpo.importance_sampling=none"], prompts=2)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(inputs)
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/rounds"] == [2] and metrics["dynamic_sampling/groups_dropped"] == [2]
    assert len(batch["advantages"]) == 16 and batch["completion_mask"].sum(1).gt(0).all()


def test_dynamic_sampling_needs_the_dapo_loss():
    """A short batch is filled with masked groups; grpo and dr_grpo count its rows (the gradient halved with one
    filler group of two), bnpo a micro-batch of filler alone: refused at load, naming the keys."""
    from pipeline.recipe import RecipeError, load_recipe

    for loss in ("grpo", "bnpo", "dr_grpo"):
        with pytest.raises(RecipeError, match=f"grpo.dynamic_sampling: needs grpo.loss_type: dapo.*{loss}"):
            load_recipe("demo", [f"grpo.loss_type={loss}"])
        load_recipe("demo", [f"grpo.loss_type={loss}", "grpo.dynamic_sampling=false"])
    load_recipe("demo", ["grpo.loss_type=dapo"])


def test_masked_tokens_leave_the_token_count(tmp_path):
    """Under token_mask (MIS) a token whose trainer / engine ratio lies outside [1 / cap, cap] leaves the loss: it is
    out of completion_mask and of num_items_in_batch, which dapo divides by (it counted there before, shrinking
    the step)."""
    trainer, _ = grpo_trainer(tmp_path, [["So \\boxed{2}"] * 8], ["grpo.importance_sampling=token_mask",
                                                                   "grpo.importance_sampling_cap=2.0"])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    trainer_logps = torch.full((2, 4), -1.0)
    engine_logps = trainer_logps + torch.tensor([[0.0, 2.0, 0.0, -2.0], [0.1, 0.0, 3.0, 0.0]])  # ratios e^-2 .. e^2
    batch = {"completion_mask": mask, "advantages": torch.tensor([1.0, -1.0]), "old_per_token_logps": trainer_logps,
             "sampling_per_token_logps": engine_logps, "num_items_in_batch": mask.sum()}
    out = trainer._correct_for_the_engine(batch)
    assert out["completion_mask"].tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]
    assert int(out["num_items_in_batch"]) == 4
    assert (out["advantages"][out["completion_mask"] == 0] == 0).all()


def test_grpo_groups_are_positions_not_equal_prompts():
    """A generation batch's groups by position: two groups of one prompt stay two (grouping by equal text merged
    them up to the limit), and a batch not laid out as TRL's sampler lays it out is refused."""
    from pipeline.stages.grpo import prompt_groups

    assert prompt_groups(["a", "a", "a", "a", "b", "b"], 2) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(RuntimeError, match="rows 2..3 of a generation batch are not one prompt's 2 samples"):
        prompt_groups(["a", "a", "a", "b"], 2)
    with pytest.raises(RuntimeError, match="not whole groups of 4"):
        prompt_groups(["a"] * 6, 4)


class SubmittedAhead(FixedCompletions):
    """:class:`FixedCompletions` with the asynchronous interface (``submit`` / ``collect``), keeping the order of
    the calls: what the trainer asks of the engines, and when."""

    def __init__(self, groups, tokenizer):
        super().__init__(groups)
        self.tokenizer, self.events, self.version = tokenizer, [], 0

    def update_weights(self, state_dict):
        self.version += 1
        self.events.append(("sync", self.version))

    def submit(self, prompt_ids, params, joins=True):
        self.events.append(("submit", tuple(self.tokenizer.decode(ids) for ids in prompt_ids), self.version))
        from pipeline.rollout.actor import Generation

        return Generation(prompt_ids, params, [], {"outputs": self.generate(prompt_ids, params)}, self.version)

    def collect(self, generation):
        self.events.append(("collect", generation.weights_version))
        return generation.pending["outputs"]


def test_generating_ahead_submits_the_next_batch_before_training_on_this_one(tmp_path):
    """grpo.max_staleness=1: at each generation batch the trainer collects the batch the engines generated ahead,
    pushes its weights, submits the next batch (its prompts from the prompt stream, not TRL's sampler) and only then
    returns this batch to train on; the next batch is one batch stale when it trains."""
    from pipeline.stages.prompt_stream import PromptStream

    trainer, inputs = grpo_trainer(tmp_path, [["So \\boxed{2}", "So \\boxed{4}"] * 4], [
        "grpo.max_staleness=1", "grpo.dynamic_sampling=false", "grpo.importance_sampling=none", "grpo.steps=3",
        "grpo.max_completion_length=16"])
    fleet = SubmittedAhead(trainer.fleet.groups, trainer.processing_class)
    trainer.fleet, trainer.state.max_steps = fleet, 3
    stream = PromptStream(len(trainer.train_dataset), 1, trainer.args.seed)
    question = [trainer.train_dataset[stream.rows(j)[0]]["prompt"] for j in range(3)]
    assert len(set(question)) == 2  # two prompts in the data: every epoch takes both, in its own order

    trainer._generate_and_score_completions(inputs)  # batch 0: nothing generated ahead yet
    assert [e[0] for e in fleet.events] == ["sync", "submit", "collect", "submit"]
    assert [question[0] in fleet.events[1][1][0], question[1] in fleet.events[3][1][0]] == [True, True]
    assert fleet.events[3][2] == 1  # batch 1 is generated by the weights batch 0 trains from
    fleet.events.clear()
    trainer.state.global_step = 1
    batch = trainer._generate_and_score_completions(inputs)
    assert [e[0] for e in fleet.events] == ["collect", "sync", "submit"]
    assert question[1] in trainer.processing_class.decode(batch["prompt_ids"][0])
    spans, counts = trainer.timer.take()
    assert counts["async/staleness"] == 1.0 and counts["async/weights_version"] == 1
    assert counts["async/off_policy_tokens"] == 1.0  # made by the weights before batch 0's step
    fleet.events.clear()
    trainer.state.global_step = 2
    trainer._generate_and_score_completions(inputs)
    assert [e[0] for e in fleet.events] == ["collect"]  # the last batch: nothing more to generate


def test_the_prompt_stream_covers_the_data_each_epoch_in_disjoint_shares():
    from pipeline.stages.prompt_stream import PromptStream

    workers = [PromptStream(10, 4, seed=3, rank=r, world=2) for r in range(2)]
    stream = sum((workers[0].rows(j) + workers[1].rows(j) for j in range(5)), [])  # 20 rows: two epochs, in order
    assert sorted(stream[:10]) == sorted(stream[10:]) == list(range(10)) and stream[:10] != stream[10:]
    assert workers[0].rows(3) == PromptStream(10, 4, seed=3, rank=0, world=2).rows(3)  # the same after a resume
    assert PromptStream(10, 4, seed=4).rows(0) != PromptStream(10, 4, seed=3).rows(0)


def test_partial_rollouts_push_the_weights_before_collecting_and_submit_the_next_batch_at_once(tmp_path):
    """grpo.partial_rollouts: at each batch the weights go to the engines while the batch still runs, the next batch
    is submitted before this one is collected (the engines start it as this one's sequences finish), and the share
    of tokens generated by older weights than the policy that trains on them is logged."""
    trainer, inputs = grpo_trainer(tmp_path, [["So \\boxed{2}", "So \\boxed{4}"] * 4], [
        "grpo.max_staleness=1", "grpo.partial_rollouts=true", "grpo.dynamic_sampling=false",
        "grpo.importance_sampling=none", "grpo.steps=3", "grpo.max_completion_length=16"])
    fleet = SubmittedAhead(trainer.fleet.groups, trainer.processing_class)
    trainer.fleet, trainer.state.max_steps = fleet, 3
    orders = []
    for step in range(3):
        fleet.events.clear()
        trainer.state.global_step = step
        trainer._generate_and_score_completions(inputs)
        orders.append([e[0] for e in fleet.events])
    assert orders == [["sync", "submit", "submit", "collect"], ["sync", "submit", "collect"], ["sync", "collect"]]
    _, counts = trainer.timer.take()
    assert counts["async/off_policy_tokens"] == 1.0  # batch 2 came whole from the weights before the last sync


def test_generating_two_batches_ahead_keeps_two_in_flight_and_needs_partial_rollouts(tmp_path):
    """grpo.max_staleness=2 (with partial rollouts): the first batch submits itself and the two after it; each later
    batch pushes the weights and submits the one two ahead (none past the last), so two batches generate while one
    trains; the batch two ahead trains two batches stale. Without partial rollouts it is refused: a sync would
    wait behind the blocking calls of the batches generating."""
    from pipeline.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="grpo.max_staleness.*2 needs grpo.partial_rollouts"):
        load_recipe("demo", ["grpo.max_staleness=2", "grpo.dynamic_sampling=false", "grpo.placement=split"])
    trainer, inputs = grpo_trainer(tmp_path, [["So \\boxed{2}", "So \\boxed{4}"] * 4], [
        "grpo.max_staleness=2", "grpo.partial_rollouts=true", "grpo.dynamic_sampling=false",
        "grpo.importance_sampling=none", "grpo.steps=4", "grpo.max_completion_length=16"])
    fleet = SubmittedAhead(trainer.fleet.groups, trainer.processing_class)
    trainer.fleet, trainer.state.max_steps = fleet, 4
    orders, staleness = [], []
    for step in range(4):
        fleet.events.clear()
        trainer.state.global_step = step
        trainer._generate_and_score_completions(inputs)
        orders.append([e[0] for e in fleet.events])
        staleness.append(trainer.timer.take()[1]["async/staleness"])
    assert orders == [["sync", "submit", "submit", "submit", "collect"], ["sync", "submit", "collect"],
                      ["sync", "collect"], ["sync", "collect"]]
    assert staleness == [0.0, 1.0, 2.0, 2.0]


def test_off_policy_share_counts_each_token_by_the_weights_that_made_it():
    from pipeline.rollout import CompletionOutput, RequestOutput
    from pipeline.rollout.actor import weight_versions
    from pipeline.stages.grpo import off_policy_share

    # a request's samples: sample 0 had 3 tokens at the switch to version 5, sample 1 had none (it began after)
    changes = [(4, {}), (5, {0: 3})]
    assert weight_versions(changes, 0) == [(0, 4), (3, 5)] and weight_versions(changes, 1) == [(0, 5)]
    outs = [RequestOutput("0", None, [1], [CompletionOutput(0, "", [7] * 10, None, "length", None, [(0, 4), (3, 5)]),
                                           CompletionOutput(1, "", [7] * 10, None, "length", None, [(0, 5)])]),
            RequestOutput("1", None, [1], [CompletionOutput(0, "", [7] * 20, None, "length")])]  # all from version 4
    assert off_policy_share(outs, started=4, current=5) == (3 + 20) / 40
    assert off_policy_share(outs, started=4, current=4) == 0.0


def test_old_logprobs_from_the_engine_skip_the_trainers_pass_and_bound_the_ratio_to_the_engine(tmp_path, monkeypatch):
    """grpo.old_logprobs=engine (verl's bypass mode): a generation batch of two mini-batches, which TRL answers with a
    no-grad pass for the old policy's log-probs, runs no trainer pass; the PPO ratio then divides by the engine's
    log-probs (-1 a token here, far above the tiny model's), so the clip acts from the batch's first step. The
    trainer's way runs the pass, and its first step's ratio is 1."""
    import pipeline.stages.grpo as grpo

    passes = []
    real = grpo.packed_logps
    monkeypatch.setattr(grpo, "packed_logps", lambda *a, **k: passes.append(torch.is_grad_enabled()) or real(*a, **k))
    right, wrong = "So \\boxed{2}", "So \\boxed{9}"
    clipped = {}
    for mode in ("engine", "trainer"):
        trainer, inputs = grpo_trainer(tmp_path / mode, [[right] * 4 + [wrong] * 4], [
            "grpo.rewards.format=0.0", "grpo.importance_sampling=none", "grpo.dynamic_sampling=false",
            f"grpo.old_logprobs={mode}", "grpo.mini_batches=2"], prompts=2)
        trainer.model.train()
        passes.clear()
        batch = trainer._generate_and_score_completions(inputs)
        assert passes == ([] if mode == "engine" else [False])  # the no-grad pass over the generation batch
        real_tokens = batch["completion_mask"].bool()
        if mode == "engine":
            assert (batch["old_per_token_logps"][real_tokens] == -1.0).all()
        trainer.current_gradient_accumulation_steps = 1  # (the training loop sets it)
        trainer.compute_loss(trainer.model, batch)
        clipped[mode] = trainer._metrics["train"]["clip_ratio/region_mean"][-1]
    assert clipped["engine"] > 0.1 and clipped["trainer"] == 0


def test_old_logprobs_from_the_engine_refuse_a_second_correction_and_top_p():
    from pipeline.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="grpo.old_logprobs: .*grpo.importance_sampling: none"):
        load_recipe("demo", ["grpo.old_logprobs=engine"])
    with pytest.raises(RecipeError, match="grpo.old_logprobs: .*top_p: 1"):
        load_recipe("demo", ["grpo.old_logprobs=engine", "grpo.importance_sampling=none", "grpo.top_p=0.9"])
    load_recipe("demo", ["grpo.old_logprobs=engine", "grpo.importance_sampling=none"])
