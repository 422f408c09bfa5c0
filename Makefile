# The README's two commands: `make demo` and `make test`. Both install first (idempotent).
VENV := .venv
PY := $(VENV)/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 3
export PYTHONUNBUFFERED := 1

.PHONY: install demo test bench bench-models bench-memory accuracy clean

install:
	./scripts/install.sh

demo: install
	$(VENV)/bin/horovodrun -np 2 -H localhost:2 --mpi $(PY) examples/torch_digits.py

# Two pytest workers, a test file each at a time: the multi-rank tests spend most of their time
# starting processes and waiting out timeouts, so two files share the two cores well (about
# 830 s of pytest serially, 2026-12-05). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The speed-up on an emulated cluster (network namespaces, shaped links; needs root): tables in the
# "throughput" section of docs/benchmarks.md and docs/img/throughput.png, samples in build/throughput.json.
# Link rates come from a calibration run first (comm/compute 0.25, 1, 2.5, 5); subsets and fixed rates:
# python -m benchmarks.throughput --help. Then the 2-host launches again with compute off the cores
# (--offload-compute: forward and backward passes as waits of their measured times, as an accelerator's
# step looks from the host): the "throughput-offloaded" section. Last, 2 hosts x 2 ranks under horovodrun, links
# shaped between the hosts only, compute off the cores: Horovod and width 2 + int8 / int4, flat against hierarchical
# (issue 33), the "hierarchical" section. Last, the model-zoo shapes (bench-models). docs/benchmarks.md says how to
# read all four.
bench: install
	$(PY) -m benchmarks.throughput
	$(PY) -m benchmarks.throughput --offload-compute --four-hosts ''
	$(PY) -m benchmarks.throughput --hierarchical
	$(PY) -m benchmarks.throughput --models --hosts 2

# ResNet-50, BERT-base and GPT-2 small at real size on the emulated cluster (issue 42; needs root): compute off the
# cores at published GPU step times, comm ~5x then ~1x compute; the "model-zoo" section of docs/benchmarks.md,
# samples in build/model-zoo.json. 2 hosts here: 4 hosts of BERT-base or GPT-2 need ~25 GiB on one machine (a
# 4-host BERT-base rank was killed for memory on this 24 GB one, 2026-12-08); add --hosts 2 4 on a larger one.
# About 15 min here (estimated from 1-round launches; --steps 2 takes a quarter off). Subsets: python -m
# benchmarks.throughput --models resnet50 --hosts 2 4 --no-doc
bench-models: install
	$(PY) -m benchmarks.throughput --models --hosts 2

# Peak memory per rank of each configuration beside Horovod's on the same models (2 ranks here, one horovodrun
# launch per configuration, AdamW): the "memory" section of docs/benchmarks.md, samples in build/memory.json.
bench-memory: install
	$(PY) -m benchmarks.memory

# The accuracy study (issue 30, benchmarks/accuracy/): writes docs/accuracy.md, docs/accuracy.json (the record)
# and docs/img/accuracy.png; 4 SGD tasks, a standard and a stress language model (AdamW), the NAdamW and Muon
# recipes, at 2 and 4 ranks: many hours on 2 cores. docs/accuracy.md came from subsets, measured 2026-12-07/08:
# the SGD tasks at 2 and 4 ranks 74 min; stdlib-lm 46 min at 2 ranks (--lr 0.002), 60 min at 4 (--configs sync
# w2-split-int8 w2-acco-int8); pydoc-lm 4 min at 2 ranks. Subsets: python -m benchmarks.accuracy --tasks ...
# --configs ... --ranks ... --seeds N --steps N --no-doc --record PATH; --from-record PATH ... rewrites the page
# from saved records.
accuracy: install
	$(PY) -m benchmarks.accuracy

clean:
	rm -rf $(VENV) build *.egg-info
