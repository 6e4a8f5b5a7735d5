"""Truncation of the random rows' distributions (vLLM v1's semantics): tokens that min_p, top_k or top_p exclude
become -inf in the logits, in place.

Per row:
 - min_p: a token goes when its probability is below min_p times the row's largest;
 - top_k (0, or the vocabulary size or more, disables): the k largest logits stay, and every logit equal to the
   k-th (as in vLLM);
 - top_p (1 disables), after top_k: in descending order of logit, a token stays while the probability mass
   strictly before it is below top_p, probabilities being the softmax of the whole top_k-masked row. The top
   token always stays (mass 0 before it). Tokens of equal logits come in any order, so where such a tie straddles
   the cutoff, the first of them in that order stay; how many is the same for every order.

On a GPU one sort of each row gives both (`_top_k_top_p_by_sort`): it needs nothing read back, so the host runs
ahead of the device. On the CPU that sort is the cost (about 120 ms for [64, 49152] float32 on the 2-core box,
against 6 ms for topk(256) and 1-3 ms for a softmax), so there top_k takes `topk` (and top_p, for a row with
both, runs on the k largest), and top_p sorts only the candidates that can matter (`_top_p_by_candidates`),
leaving to the sort the rows it cannot settle (flat ones).
The paths keep the same tokens but where float32 rounding decides: their softmaxes sum the same terms in other
orders (the sort's in descending order, which loses more of the small ones), so a token whose mass before it is
within some 1e-5 of top_p may go either way. On [64, 49152] rows of randn * 3 / 0.8 with top_p 0.95, about one
row in twenty keeps one token more than the sort's path does; a float64 computation keeps it too.
"""

from __future__ import annotations

import math

import torch

# A top_p row is settled without the tokens past its candidates once the last candidate goes, or once the
# candidates' float32 cumulative sum reaches top_p + _SETTLED_MARGIN: then every later token has float32 mass
# before it of at least that sum less an ulp of it (2^-24 below 1, 2^-23 just above), so >= top_p. The candidates
# are the tokens of the row's highest probability bins whose (float32) sums reach top_p + _CANDIDATE_MARGIN: four
# times the other margin, for the rounding of those sums, so that rows rarely fail to settle.
_CANDIDATE_MARGIN = 2.0**-20
_SETTLED_MARGIN = 2.0**-22
# A non-negative float32 ordered as its bit pattern: the exponent and the top 3 bits of the mantissa make bins of
# an eighth of an octave, and the probabilities [0, 1] fall in bins 0 ... 0x3F800000 >> 20.
_BIN_SHIFT = 20
_NUM_BINS = (0x3F800000 >> _BIN_SHIFT) + 1


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Masks tokens whose probability is below min_p times the row's largest. logits: [num_rows, vocab];
    min_p: [num_rows] float32 on the logits' device."""
    probs = logits.softmax(dim=-1)
    logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1), -math.inf)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Masks, per row, all but the top_k logits (ties with the k-th stay), then all but the smallest set of the
    rest whose probability sums to at least top_p (see the module's docstring). top_k 0 and top_p 1 disable.
    logits: [num_rows, vocab]; top_k: [num_rows] long; top_p: [num_rows] float32; all on one device."""
    vocab_size = logits.shape[1]
    top_k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    # top_p 1 becomes inf: rounding could push the cumulative sum to 1 before the tail and drop it.
    top_p = torch.where(top_p < 1, top_p, math.inf)
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        _top_k_top_p_by_sort(logits, top_k, top_p)
        return
    # On the CPU reading the parameters back costs nothing.
    settled = _top_k_by_topk(logits, top_k, top_p)
    top_p_rows = [i for i, p in enumerate(top_p.tolist()) if p < 1 and i not in settled]
    if not top_p_rows:
        return
    if len(top_p_rows) == logits.shape[0]:
        unsettled = _top_p_by_candidates(logits, top_p)
    else:
        index = torch.tensor(top_p_rows)
        selected = logits[index]
        unsettled = [top_p_rows[i] for i in _top_p_by_candidates(selected, top_p[index])]
        logits[index] = selected
    # top_k is applied already, and applying it again changes nothing.
    if len(unsettled) == logits.shape[0]:
        _top_k_top_p_by_sort(logits, top_k, top_p)
    elif unsettled:
        index = torch.tensor(unsettled)
        selected = logits[index]
        _top_k_top_p_by_sort(selected, top_k[index], top_p[index])
        logits[index] = selected


def _top_k_top_p_by_sort(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Both by one full sort of each row. top_k: vocab disables; top_p: inf disables."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    kth_logit = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth_logit, -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), -math.inf)
    logits.scatter_(1, sorted_ids, sorted_logits)


def _top_k_by_topk(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> set[int]:
    """top_k by the k-th largest logit of each row that has one: topk of the largest k, not a sort of the row.
    top_p too, among those largest, in the rows that have it and whose tokens top_k leaves all lie there (unless
    the k-th ties with tokens past them): returns those rows. top_k: vocab disables; top_p: inf disables."""
    num_rows, vocab_size = logits.shape
    k_rows = [i for i, k in enumerate(top_k.tolist()) if k < vocab_size]
    if not k_rows:
        return set()
    index = torch.tensor(k_rows)
    k = top_k[index]
    # One more than the largest k: in a row whose last one is below its k-th, top_k leaves no token past them.
    top_logits, top_ids = logits[index].topk(int(k.max()) + 1, dim=-1)  # sorted, largest first
    kth_logit = top_logits.gather(1, (k - 1).unsqueeze(1))
    all_kth_logits = torch.full((num_rows, 1), -math.inf)
    all_kth_logits[index] = kth_logit
    logits.masked_fill_(logits < all_kth_logits, -math.inf)

    p = top_p[index]
    settled = (top_logits[:, -1:] < kth_logit).squeeze(1) & (p < 1)
    if not settled.any():
        return set()
    # The softmax of the row that top_k leaves is that of these logits with the rest at -inf.
    top_logits.masked_fill_(top_logits < kth_logit, -math.inf)
    probs = top_logits.softmax(dim=-1)
    dropped = (probs.cumsum(dim=-1) - probs >= p.unsqueeze(1)) & (top_logits > -math.inf) & settled.unsqueeze(1)
    dropped_rows, dropped_slots = dropped.nonzero(as_tuple=True)
    dropped_index = index[dropped_rows] * vocab_size + top_ids[dropped_rows, dropped_slots]
    logits.view(-1).index_fill_(0, dropped_index, -math.inf)
    return {k_rows[i] for i in settled.nonzero().flatten().tolist()}


def _top_p_by_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> list[int]:
    """top_p on the CPU without sorting whole rows. logits: [num_rows, vocab] float32, contiguous; top_p:
    [num_rows] float32, each < 1. Returns the rows it left untouched, for the sort: those whose candidates are
    too many (flat distributions) or none (logits that are not numbers), or whose candidates' mass came within
    rounding of top_p."""
    num_rows, vocab_size = logits.shape
    probs = logits.softmax(dim=-1)
    flat_index, num_candidates = _candidates(logits, probs, top_p, max_candidates=vocab_size // 4)
    fits = num_candidates > 0
    if not fits.any():
        return list(range(num_rows))
    sorted_logits, sorted_ids = _sorted_candidates(logits, flat_index, num_candidates)
    # [num_rows, max candidates], padded with -inf: a candidate has a positive probability, so a finite logit.
    is_candidate = sorted_logits > -math.inf
    sorted_probs = probs.gather(1, sorted_ids).masked_fill_(~is_candidate, 0)
    cumulative = sorted_probs.cumsum(dim=1)
    keep = (cumulative - sorted_probs < top_p.unsqueeze(1)) & is_candidate

    # Settled: the last candidate goes (and so, the mass before a token never falling along the row, does every
    # later one), or the candidates' mass reaches top_p with the margin that rounding of later tokens cannot eat.
    last = (num_candidates - 1).clamp_(min=0).unsqueeze(1)
    settled = ~keep.gather(1, last) | (cumulative.gather(1, last) >= (top_p + _SETTLED_MARGIN).unsqueeze(1))
    settled = settled.squeeze(1) & fits
    keep &= settled.unsqueeze(1)
    if settled.all():
        logits.fill_(-math.inf)
    else:
        logits[settled] = -math.inf
    kept = keep.view(-1).nonzero().squeeze(1)
    width = keep.shape[1]
    kept_index = kept // width * vocab_size + sorted_ids.view(-1).index_select(0, kept)
    logits.view(-1).index_copy_(0, kept_index, sorted_logits.view(-1).index_select(0, kept))
    return (~settled).nonzero().flatten().tolist()


def _candidates(
    logits: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, max_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates of each row for top_p: the tokens of its highest probability bins that hold top_p of its
    mass (and a margin). Returns their indices into the flattened logits, row by row, and each row's number of
    them: none for a row with more than max_candidates or whose logits are not all numbers.

    A row's probabilities are binned by their float32 bits, which order as the probabilities (and so as the
    logits) do. Hence the candidates are a prefix of the row in descending order, ties included (equal logits,
    equal bins): sorting them alone gives the cumulative sums that sorting the row would."""
    num_rows = probs.shape[0]
    bins = probs.view(torch.int32) >> _BIN_SHIFT  # [num_rows, vocab], in 0 ... _NUM_BINS - 1 where finite
    not_finite = ~logits.amax(dim=-1).isfinite()
    if not_finite.any():
        # Their probabilities are NaN, negative NaN here, whose bits make negative bins: those would count in
        # the row before. In bin 0 the NaN mass reaches no top_p.
        bins[not_finite] = 0
    # Every row's bins in one bincount: row i's are i * _NUM_BINS + bin. int32 throughout: an int64 operand
    # would widen the whole [num_rows, vocab] tensor, and each new tensor of that size costs more in page faults
    # than the pass that fills it.
    offsets = torch.arange(0, num_rows * _NUM_BINS, _NUM_BINS, dtype=torch.int32).unsqueeze(1)
    bins += offsets
    mass = torch.bincount(bins.flatten(), probs.flatten(), minlength=num_rows * _NUM_BINS)
    mass_from_top = mass.view(num_rows, _NUM_BINS).flip(1).cumsum(dim=1)
    # The number of bins, counted from the top, whose mass from the top reaches top_p: bins 0 ... that - 1 are
    # those below the candidates. When none reaches, the lowest bin is past the row's bins: no candidates.
    num_reaching = (mass_from_top >= (top_p + _CANDIDATE_MARGIN).unsqueeze(1)).sum(dim=1, dtype=torch.int32)
    lowest_bin = torch.where(num_reaching > 0, num_reaching - 1, _NUM_BINS)
    candidates = bins >= lowest_bin.unsqueeze(1) + offsets
    # Summed as bytes: a sum of bools widens them to int64 first (2-3x slower).
    num_candidates = candidates.view(torch.uint8).sum(dim=1, dtype=torch.int32)
    too_many = num_candidates > max_candidates
    if too_many.any():
        candidates[too_many] = False
        num_candidates[too_many] = 0
    return candidates.view(-1).nonzero().squeeze(1), num_candidates.long()


def _sorted_candidates(
    logits: torch.Tensor, flat_index: torch.Tensor, num_candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates' logits sorted in descending order, and their token ids: [num_rows, max candidates], each
    row padded with -inf (id 0). flat_index: the candidates' indices into the flattened logits, row by row.
    Indexing the flattened tensors in one dimension is several times faster than by (row, id) pairs."""
    num_rows, vocab_size = logits.shape
    width = int(num_candidates.max())
    row_of = flat_index // vocab_size
    # A candidate's place in its row of the padded tensor: its index less those of the rows before.
    padded_index = (
        row_of * width + torch.arange(flat_index.numel()) - (num_candidates.cumsum(0) - num_candidates)[row_of]
    )
    padded_logits = torch.full((num_rows * width,), -math.inf)
    padded_logits.index_copy_(0, padded_index, logits.view(-1).index_select(0, flat_index))
    padded_ids = torch.zeros(num_rows * width, dtype=torch.long)
    padded_ids.index_copy_(0, padded_index, flat_index - row_of * vocab_size)
    sorted_logits, order = padded_logits.view(num_rows, width).sort(dim=1, descending=True)
    return sorted_logits, padded_ids.view(num_rows, width).gather(1, order)
