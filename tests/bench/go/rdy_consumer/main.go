// rdy_consumer: a go-nsq Consumer with its default configuration but max_in_flight (and
// rdy_redistribute_interval when given), a no-op handler (every message FIN'd), reading topic/channel
// from every nsqd given for a fixed duration, or until -expect messages have come. One JSON line on stdout: {"delivered": N, "seconds": S, "per_second": R}.
// The RDY bench (tests/bench/client_rdy.py) builds and runs it beside trio_nsq.client.Consumer.
package main

import (
	"encoding/json"
	"flag"
	"log"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nsqio/go-nsq"
)

func main() {
	nsqds := flag.String("nsqd-tcp-addresses", "", "comma-separated nsqd TCP addresses")
	topic := flag.String("topic", "", "topic")
	channel := flag.String("channel", "", "channel")
	maxInFlight := flag.Int("max-in-flight", 1, "max_in_flight")
	redistribute := flag.Duration("rdy-redistribute-interval", 0, "RDYRedistributeInterval (0: go-nsq's default)")
	duration := flag.Duration("duration", 8*time.Second, "how long to read")
	expect := flag.Int64("expect", 0, "stop once this many messages have come (0: read for -duration)")
	flag.Parse()

	config := nsq.NewConfig()
	config.MaxInFlight = *maxInFlight
	if *redistribute > 0 {
		config.RDYRedistributeInterval = *redistribute
	}
	consumer, err := nsq.NewConsumer(*topic, *channel, config)
	if err != nil {
		log.Fatal(err)
	}
	consumer.SetLogger(log.New(os.Stderr, "", log.LstdFlags), nsq.LogLevelWarning)
	var delivered int64
	done := make(chan struct{})
	consumer.AddHandler(nsq.HandlerFunc(func(m *nsq.Message) error {
		if atomic.AddInt64(&delivered, 1) == *expect {
			close(done)
		}
		return nil
	}))

	started := time.Now()
	if err := consumer.ConnectToNSQDs(strings.Split(*nsqds, ",")); err != nil {
		log.Fatal(err)
	}
	select {
	case <-time.After(*duration):
	case <-done:
	}
	seconds := time.Since(started).Seconds()
	count := atomic.LoadInt64(&delivered)
	consumer.Stop()
	<-consumer.StopChan
	json.NewEncoder(os.Stdout).Encode(map[string]interface{}{
		"delivered": count, "seconds": seconds, "per_second": float64(count) / seconds,
	})
}
