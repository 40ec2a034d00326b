# One image with both commands: trio-nsqd and trio-nsqlookupd (and the examples).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY lookupd ./lookupd
COPY shared ./shared
COPY trio_nsq ./trio_nsq
COPY pyspark_nsq.py ./
COPY examples ./examples
RUN pip install --no-cache-dir .
EXPOSE 4150 4151 4160 4161
CMD ["trio-nsqd", "--data-path=/data"]
