// Command conformance checks that a Talos API server (the project's node simulator, or a real Talos node)
// answers Talos's own Go client library, github.com/siderolabs/talos/pkg/machinery, the way talosctl
// uses it: the talosconfig is opened with clientconfig.Open, the client dials the talosconfig endpoints
// over mutual TLS, and every request is routed to one node with the `node` metadata header.
//
//	conformance --talosconfig PATH --node IP [--worker-node IP] [--upgrade-image REF] [--timeout 60s]
//
// Built with -modfile=go114.mod -tags talos114 (machinery v1.14.1) it also takes the flags of talos114.go.
//
// --node is a control-plane node. One `PASS name[node]: detail` or `FAIL name[node]: error` line is
// printed per check; the exit status is 1 if any check failed, 2 on bad usage or an unusable talosconfig.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/state"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	machineapi "github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
)

type check func(ctx context.Context, c *client.Client) (detail string, err error)

// extraChecks, when set (talos114.go, built with -tags talos114 against machinery v1.14.1), runs the
// checks of Talos 1.14's surface after the base ones; its flags are registered before main parses them.
var extraChecks func(run func(name, target string, fn check))

func main() {
	talosconfig := flag.String("talosconfig", "", "`path` of the talosconfig (required)")
	node := flag.String("node", "", "control-plane node `IP` to check, sent in the node header (required)")
	worker := flag.String("worker-node", "", "worker node `IP` to check and, with --upgrade-image, to upgrade")
	image := flag.String("upgrade-image", "", "installer image `ref` for the legacy Upgrade check (skipped if empty)")
	timeout := flag.Duration("timeout", 60*time.Second, "time limit for each check")
	flag.Parse()

	if *talosconfig == "" || *node == "" || flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}

	// clientconfig.Open creates a missing file (as talosctl does); a checker must not, so look first.
	if _, err := os.Stat(*talosconfig); err != nil {
		fmt.Fprintf(os.Stderr, "conformance: %v\n", err)
		os.Exit(2)
	}

	cfg, err := clientconfig.Open(*talosconfig)
	if err != nil {
		fmt.Fprintf(os.Stderr, "conformance: %v\n", err)
		os.Exit(2)
	}

	// client.New does not dial: connection and TLS errors surface in the first check that makes a call.
	c, err := client.New(context.Background(), client.WithConfig(cfg))
	if err != nil {
		fmt.Fprintf(os.Stderr, "conformance: %v\n", err)
		os.Exit(2)
	}
	defer c.Close() //nolint:errcheck

	failed := 0
	run := func(name, target string, fn check) {
		// WithNode sets the `node` header: the endpoint (a control plane) proxies the call to target.
		ctx, cancel := context.WithTimeout(client.WithNode(context.Background(), target), *timeout)
		defer cancel()

		if detail, err := fn(ctx, c); err != nil {
			failed++
			fmt.Printf("FAIL %s[%s]: %v\n", name, target, err)
		} else {
			fmt.Printf("PASS %s[%s]: %s\n", name, target, detail)
		}
	}

	run("Version", *node, checkVersion)
	run("ServiceList", *node, checkServices(true))
	run("EtcdMemberList", *node, checkEtcdMembers)
	run("Events", *node, checkEvents)
	run("COSIGet", *node, checkCOSIGet)
	run("COSIWatch", *node, checkCOSIWatch)

	upgradeTarget := *node
	if *worker != "" {
		upgradeTarget = *worker
		run("Version", *worker, checkVersion)
		run("ServiceList", *worker, checkServices(false))
	}

	if *image != "" {
		run("Upgrade", upgradeTarget, checkUpgrade(*image))
	}

	if extraChecks != nil {
		extraChecks(run)
	}

	if failed > 0 {
		fmt.Fprintf(os.Stderr, "conformance: %d check(s) failed\n", failed)
		os.Exit(1)
	}
}

// single unwraps a unary reply. The `node` header targets one node, so apid proxies the call as is and
// exactly one message comes back (several would mean the server fanned out as for the `nodes` header).
func single[T any](msgs []T) (T, error) {
	if len(msgs) != 1 {
		var zero T
		return zero, fmt.Errorf("%d messages, want 1", len(msgs))
	}

	return msgs[0], nil
}

func version(ctx context.Context, c *client.Client) (tag, platform string, err error) {
	resp, err := c.Version(ctx)
	if err != nil {
		return "", "", err
	}

	msg, err := single(resp.GetMessages())
	return msg.GetVersion().GetTag(), msg.GetPlatform().GetName(), err
}

// checkVersion is `talosctl version`: a tag such as v1.11.6 and the platform the node booted on.
func checkVersion(ctx context.Context, c *client.Client) (string, error) {
	tag, platform, err := version(ctx, c)

	switch {
	case err != nil:
		return "", err
	case !strings.HasPrefix(tag, "v"):
		return "", fmt.Errorf("tag %q does not start with v", tag)
	case platform == "":
		return "", errors.New("empty platform name")
	}

	return fmt.Sprintf("tag %s, platform %s", tag, platform), nil
}

// checkServices is `talosctl services`: apid and machined run everywhere, etcd only on control planes.
func checkServices(controlPlane bool) check {
	return func(ctx context.Context, c *client.Client) (string, error) {
		resp, err := c.ServiceList(ctx)
		if err != nil {
			return "", err
		}

		list, err := single(resp.GetMessages())
		if err != nil {
			return "", err
		}

		states := map[string]string{}
		for _, svc := range list.GetServices() {
			states[svc.GetId()] = svc.GetState()
		}

		for _, want := range []string{"apid", "machined"} {
			if _, ok := states[want]; !ok {
				return "", fmt.Errorf("service %s missing from %v", want, states)
			}
		}

		if _, ok := states["etcd"]; ok != controlPlane {
			return "", fmt.Errorf("etcd listed=%v on a node with control plane=%v: %v", ok, controlPlane, states)
		}

		return fmt.Sprint(states), nil
	}
}

// checkEtcdMembers is `talosctl etcd members`, which the upgrade's etcd health gate relies on.
func checkEtcdMembers(ctx context.Context, c *client.Client) (string, error) {
	resp, err := c.EtcdMemberList(ctx, &machineapi.EtcdMemberListRequest{})
	if err != nil {
		return "", err
	}

	list, err := single(resp.GetMessages())
	if err != nil {
		return "", err
	}

	var names []string
	for _, m := range list.GetMembers() {
		if m.GetId() == 0 || m.GetHostname() == "" {
			return "", fmt.Errorf("member without id or hostname: %v", m)
		}

		names = append(names, fmt.Sprintf("%s(%x)", m.GetHostname(), m.GetId()))
	}

	if len(names) == 0 {
		return "", errors.New("no members")
	}

	return fmt.Sprintf("%d members: %s", len(names), strings.Join(names, " ")), nil
}

// checkEvents is `talosctl events --tail -1`. EventsWatchV2 fails unless the server first sends the empty
// hello event (which it swallows), then reports any event it cannot decode (an unknown type URL or a bad
// payload) as an error on the channel, so reading until the stream goes quiet proves every replayed
// event decodes, not just the first.
func checkEvents(ctx context.Context, c *client.Client) (string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the stream and the library's receiving goroutine

	ch := make(chan client.EventResult)
	if err := c.EventsWatchV2(ctx, ch, client.WithTailEvents(-1)); err != nil {
		return "", err
	}

	counts, total := map[string]int{}, 0
	quiet := time.NewTimer(time.Hour) // armed by the first event

	// fmt prints maps sorted by key: "decoded 7: map[MachineStatusEvent:2 SequenceEvent:5]".
	summary := func() (string, error) { return fmt.Sprintf("decoded %d: %v", total, counts), nil }

	// Stop once the replayed history has been read: the stream goes quiet, or it stays busy for too long.
	for total < 1000 {
		select {
		case res := <-ch:
			if res.Error != nil {
				return "", fmt.Errorf("after %d events: %w", total, res.Error)
			}

			if res.Event.ID == "" {
				return "", fmt.Errorf("event %s without id", res.Event.TypeURL)
			}

			total++
			counts[strings.TrimPrefix(res.Event.TypeURL, "talos/runtime/machine.")]++
			quiet.Reset(500 * time.Millisecond)
		case <-quiet.C:
			return summary()
		case <-ctx.Done():
			if total > 0 {
				return summary()
			}

			return "", fmt.Errorf("no event received: %w", ctx.Err())
		}
	}

	return summary()
}

var machineStatus = resource.NewMetadata(runtime.NamespaceName, runtime.MachineStatusType, runtime.MachineStatusID,
	resource.VersionUndefined)

// checkCOSIGet is `talosctl get machinestatus`: the spec travels protobuf-encoded and the client decodes it
// into the Go type that resources/runtime registers, so a wrong field number or enum value fails here.
func checkCOSIGet(ctx context.Context, c *client.Client) (string, error) {
	r, err := c.COSI.Get(ctx, machineStatus)
	if err != nil {
		return "", err
	}

	return describeMachineStatus(r)
}

// checkCOSIWatch is `talosctl get machinestatus --watch`. The adapter needs the empty bootstrap message
// first; after it, the existing resource must arrive as a Created event.
func checkCOSIWatch(ctx context.Context, c *client.Client) (string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	ch := make(chan state.Event)
	if err := c.COSI.Watch(ctx, machineStatus, ch); err != nil {
		return "", err
	}

	select {
	case ev := <-ch:
		switch ev.Type { //nolint:exhaustive
		case state.Errored:
			return "", ev.Error
		case state.Created:
			detail, err := describeMachineStatus(ev.Resource)
			return "Created: " + detail, err
		default:
			return "", fmt.Errorf("first event is %s, want Created", ev.Type)
		}
	case <-ctx.Done():
		return "", fmt.Errorf("no watch event: %w", ctx.Err())
	}
}

// describeMachineStatus expects what a node of a freshly started, healthy cluster reports.
func describeMachineStatus(r resource.Resource) (string, error) {
	ms, ok := r.(*runtime.MachineStatus)
	if !ok {
		return "", fmt.Errorf("resource decoded as %T, want *runtime.MachineStatus", r)
	}

	md, spec := ms.Metadata(), ms.TypedSpec()
	if md.Namespace() != runtime.NamespaceName || md.ID() != runtime.MachineStatusID {
		return "", fmt.Errorf("metadata %s/%s, want %s/%s", md.Namespace(), md.ID(), runtime.NamespaceName,
			runtime.MachineStatusID)
	}

	if spec.Stage != runtime.MachineStageRunning || !spec.Status.Ready {
		return "", fmt.Errorf("stage %s, ready %v (unmet %v), want running and ready", spec.Stage,
			spec.Status.Ready, spec.Status.UnmetConditions)
	}

	return fmt.Sprintf("version %s, stage %s, ready %v", md.Version(), spec.Stage, spec.Status.Ready), nil
}

// checkUpgrade is the legacy `talosctl upgrade --image REF --preserve` (MachineService.Upgrade, what the
// controller uses on Talos 1.11): the node acknowledges, reboots, and comes back on the image's tag.
func checkUpgrade(image string) check {
	return func(ctx context.Context, c *client.Client) (string, error) {
		want := imageTag(image)
		if want == "" {
			return "", fmt.Errorf("image %q has no tag", image)
		}

		resp, err := c.UpgradeWithOptions(ctx, client.WithUpgradeImage(image), client.WithUpgradePreserve(true))
		if err != nil {
			return "", err
		}

		ack, err := single(resp.GetMessages())
		if err != nil {
			return "", err
		}

		if ack.GetAck() == "" || ack.GetActorId() == "" {
			return "", fmt.Errorf("empty ack %q or actor id %q", ack.GetAck(), ack.GetActorId())
		}

		// While the node reboots its API is gone: the proxying endpoint answers Unavailable, or the call
		// outlives its own short deadline. Any other error is a real failure.
		started, unavailable, last := time.Now(), 0, ""

		for {
			pollCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
			tag, _, err := version(pollCtx, c)
			pollTimedOut := pollCtx.Err() != nil && ctx.Err() == nil

			cancel()

			switch {
			case err == nil && tag == want:
				return fmt.Sprintf("ack %q, actor %s; back on %s after %s (%d unavailable polls)", ack.GetAck(),
					ack.GetActorId(), tag, time.Since(started).Round(time.Millisecond), unavailable), nil
			case err == nil:
				last = tag // still the old version: the node has not gone down yet
			case status.Code(err) == codes.Unavailable || pollTimedOut:
				unavailable++
			default:
				return "", fmt.Errorf("waiting for %s: %w", want, err)
			}

			select {
			case <-ctx.Done():
				return "", fmt.Errorf("not back on %s (last tag %q, %d unavailable polls): %w", want, last,
					unavailable, ctx.Err())
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// imageTag returns the tag of an image reference (ghcr.io/siderolabs/installer:v1.12.0 -> v1.12.0),
// ignoring a digest and a registry port.
func imageTag(ref string) string {
	ref, _, _ = strings.Cut(ref, "@")
	if i := strings.LastIndex(ref, ":"); i >= 0 && !strings.Contains(ref[i:], "/") {
		return ref[i+1:]
	}

	return ""
}
