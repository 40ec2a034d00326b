PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	@mkdir -p data
	@echo "trio-nsq: lookupd on 127.0.0.1:4160/4161, broker on 127.0.0.1:4150/4151 (data in ./data)"
	@echo "  publish: curl -d 'hello' 'http://127.0.0.1:4151/pub?topic=test'"
	@echo "  consume: $(BIN)/python -m shared.client.tail --topic test   (or any NSQ client)"
	@echo "  stats:   curl 'http://127.0.0.1:4151/stats?format=json'"
	$(BIN)/python -m broker --data-path=./data

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) data .pytest_cache .hypothesis
