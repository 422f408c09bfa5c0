"""Everything behind ``staleness_correction=``: weight prediction (``prediction.py``: the last
update extrapolated, or Adam's own next step), the gradient-side corrections that keep per-step
state (``corrections.py``: delay compensation, eager mixing) and their formulas (``formulas.py``)."""
