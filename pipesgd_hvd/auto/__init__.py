"""``width="auto"`` / ``compression="auto"``: the rule (``rule.py``), the controller that measures
and switches on every rank at the same step (``controller.py``), and the timing model of the paper
whose terms the rule uses (``model.py``)."""
