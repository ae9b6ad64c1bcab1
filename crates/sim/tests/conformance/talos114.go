//go:build talos114

// The checks of Talos 1.14's surface, built only against machinery v1.14.1 (go114.mod, tag talos114): the
// packages they use (the multi-document Kubernetes configs, stdpatches, the image factory constants, the
// ImageFactorySchematic resource) do not exist in the v1.12 module the base program is built with.
//
//	--platform IP=NAME   Version and PlatformMetadata of the node report platform NAME (repeatable)
//	--schematic IP=ID    the node booted from an Image Factory asset with schematic ID (repeatable)
//	--config IP=SHAPE    the node's MachineConfig decodes and validates as Talos 1.14 does; SHAPE is
//	                     multidoc (the Kube* documents) or v1alpha1 (the legacy fields) (repeatable)
//	--apply-node IP      bump the node's KubeAPIServerConfig image one patch the way talosctl 1.14
//	                     upgrade-k8s does (stdpatches, ApplyConfiguration NO_REBOOT); then a 1.13-era
//	                     v1alpha1 patch of the same image must be refused
//	--pull-node IP       the generic installer is gone for 1.14, the Image Factory one is there

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/blang/semver/v4"
	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/safe"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	machineapi "github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/configloader"
	"github.com/siderolabs/talos/pkg/machinery/config/configpatcher"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/stdpatches"
	"github.com/siderolabs/talos/pkg/machinery/config/types/k8s"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/gendata"
	configres "github.com/siderolabs/talos/pkg/machinery/resources/config"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	talosversion "github.com/siderolabs/talos/pkg/machinery/version"
)

// pairs is a repeatable `IP=VALUE` flag, in the order given.
type pairs [][2]string

func (p *pairs) String() string { return fmt.Sprint(*p) }

func (p *pairs) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || k == "" || val == "" {
		return fmt.Errorf("want IP=VALUE, got %q", v)
	}

	*p = append(*p, [2]string{k, val})

	return nil
}

// list is a repeatable flag.
type list []string

func (l *list) String() string { return strings.Join(*l, ",") }

func (l *list) Set(v string) error {
	*l = append(*l, v)

	return nil
}

var (
	platformFlags, schematicFlags, configFlags pairs
	applyNodes, pullNodes                      list
)

func init() {
	flag.Var(&platformFlags, "platform", "`IP=NAME`: the node's expected platform (repeatable)")
	flag.Var(&schematicFlags, "schematic", "`IP=ID`: the node's expected Image Factory schematic (repeatable)")
	flag.Var(&configFlags, "config", "`IP=SHAPE`: validate the node's config; SHAPE multidoc or v1alpha1 (repeatable)")
	flag.Var(&applyNodes, "apply-node", "`IP` of a control plane whose kube-apiserver image is bumped one patch (repeatable)")
	flag.Var(&pullNodes, "pull-node", "`IP` of a node to pull installer images on (repeatable)")

	extraChecks = func(run func(name, target string, fn check)) {
		for _, p := range platformFlags {
			run("Platform", p[0], checkPlatform(p[1]))
		}

		for _, s := range schematicFlags {
			run("Schematic", s[0], checkSchematic(s[1]))
		}

		for _, c := range configFlags {
			run("MachineConfig", c[0], checkMachineConfig(c[1]))
		}

		for _, n := range applyNodes {
			run("ApplyKubeAPIServerImage", n, checkApplyAPIServerImage)
			run("ApplyConflictRefused", n, checkApplyConflictRefused)
		}

		for _, n := range pullNodes {
			run("PullGenericInstaller", n, checkPullGenericInstaller)
			run("PullFactoryInstaller", n, checkPullFactoryInstaller)
		}
	}
}

// checkPlatform is `talosctl version` and `talosctl get platformmetadata`: both name the platform the node
// booted on; the mode is Talos's runtime mode, `metal` on bare metal and `cloud` on a cloud platform.
func checkPlatform(want string) check {
	return func(ctx context.Context, c *client.Client) (string, error) {
		resp, err := c.Version(ctx)
		if err != nil {
			return "", err
		}

		msg, err := single(resp.GetMessages())
		if err != nil {
			return "", err
		}

		wantMode := "cloud"
		if want == "metal" {
			wantMode = "metal"
		}

		if got := msg.GetPlatform(); got.GetName() != want || got.GetMode() != wantMode {
			return "", fmt.Errorf("Version platform %q mode %q, want %q mode %q", got.GetName(), got.GetMode(), want, wantMode)
		}

		md, err := safe.StateGetByID[*runtime.PlatformMetadata](ctx, c.COSI, runtime.PlatformMetadataID)
		if err != nil {
			return "", fmt.Errorf("PlatformMetadata: %w", err)
		}

		spec := md.TypedSpec()
		if spec.Platform != want || spec.Hostname == "" {
			return "", fmt.Errorf("PlatformMetadata platform %q hostname %q, want platform %q and a hostname", spec.Platform,
				spec.Hostname, want)
		}

		return fmt.Sprintf("Version %s/%s, PlatformMetadata %s (hostname %s)", msg.GetPlatform().GetName(),
			msg.GetPlatform().GetMode(), spec.Platform, spec.Hostname), nil
	}
}

// checkSchematic is what Omni reads to keep a node's schematic: the virtual `schematic` extension, and on
// 1.14 the ImageFactorySchematic resource derived from it.
func checkSchematic(want string) check {
	return func(ctx context.Context, c *client.Client) (string, error) {
		extensions, err := safe.StateListAll[*runtime.ExtensionStatus](ctx, c.COSI)
		if err != nil {
			return "", fmt.Errorf("ExtensionStatuses: %w", err)
		}

		found := ""

		for ext := range extensions.All() {
			if ext.TypedSpec().Metadata.Name == constants.ImageFactorySchematicExtensionName {
				found = ext.TypedSpec().Metadata.Version
			}
		}

		if found != want {
			return "", fmt.Errorf("extension %q has version %q, want %q", constants.ImageFactorySchematicExtensionName, found, want)
		}

		schematic, err := safe.StateGetByID[*runtime.ImageFactorySchematic](ctx, c.COSI, runtime.ImageFactorySchematicID)
		if err != nil {
			return "", fmt.Errorf("ImageFactorySchematic: %w", err)
		}

		if got := schematic.TypedSpec(); got.SchematicID != want || got.APIURL == "" || got.Flavor == "" {
			return "", fmt.Errorf("ImageFactorySchematic %+v, want schematic %s with a flavor and an API URL", *got, want)
		}

		return fmt.Sprintf("extension and ImageFactorySchematic: %s (%s, %s)", want,
			schematic.TypedSpec().Flavor, schematic.TypedSpec().APIURL), nil
	}
}

// metalMode is Talos's runtime mode on bare metal (talos internal/app/machined/pkg/runtime/mode.go,
// ModeMetal): an installed system, not a container. It is what a metal node validates its config with.
type metalMode struct{}

func (metalMode) String() string        { return "metal" }
func (metalMode) RequiresInstall() bool { return true }
func (metalMode) InContainer() bool     { return false }

// machineConfig reads the node's active config (`talosctl get machineconfig v1alpha1`) and decodes its
// bytes again with configloader.NewFromBytes, the loader machined itself uses.
func machineConfig(ctx context.Context, c *client.Client) (config.Provider, error) {
	res, err := c.COSI.Get(ctx, resource.NewMetadata(configres.NamespaceName, configres.MachineConfigType,
		configres.ActiveID, resource.VersionUndefined))
	if err != nil {
		return nil, fmt.Errorf("MachineConfig: %w", err)
	}

	mc, ok := res.(*configres.MachineConfig)
	if !ok {
		return nil, fmt.Errorf("MachineConfig decoded as %T", res)
	}

	raw, err := mc.Provider().Bytes()
	if err != nil {
		return nil, err
	}

	return configloader.NewFromBytes(raw)
}

// validate is the validation machined runs on a config it is given (not Local, so the image tags are
// checked against this Talos version's Kubernetes range).
func validate(cfg config.Provider) error {
	_, err := cfg.ValidateAsClient(metalMode{})

	return err
}

// kubeKinds are the documents a config created on Talos 1.14 carries for its Kubernetes components
// (config/generate with the 1.14 contract): KubeletConfig everywhere, the rest on control planes.
var kubeKinds = []string{k8s.KubeletConfig, k8s.KubeAPIServerConfig, k8s.KubeControllerManagerConfig, k8s.KubeSchedulerConfig,
	k8s.KubeProxyConfig}

func checkMachineConfig(shape string) check {
	return func(ctx context.Context, c *client.Client) (string, error) {
		cfg, err := machineConfig(ctx, c)
		if err != nil {
			return "", err
		}

		if err = validate(cfg); err != nil {
			return "", fmt.Errorf("validation: %w", err)
		}

		controlPlane := cfg.Machine().Type().IsControlPlane()
		legacy := cfg.RawV1Alpha1()

		var present []string

		for _, kind := range kubeKinds {
			if cfg.Has(kind) {
				present = append(present, kind)
			}
		}

		switch shape {
		case "multidoc":
			want := 1
			if controlPlane {
				want = len(kubeKinds)
			}

			if len(present) != want {
				return "", fmt.Errorf("documents %v on a node with control plane=%v", present, controlPlane)
			}

			if legacy.MachineConfig.MachineKubelet != nil || legacy.ClusterConfig.APIServerConfig != nil { //nolint:staticcheck
				return "", errors.New("a multi-document config still has .machine.kubelet or .cluster.apiServer")
			}
		case "v1alpha1":
			if len(present) != 0 {
				return "", fmt.Errorf("documents %v in a v1alpha1-shaped config", present)
			}
		default:
			return "", fmt.Errorf("unknown shape %q", shape)
		}

		images := fmt.Sprintf("kubelet %s", cfg.K8sKubeletConfig().Image())
		if controlPlane {
			images += fmt.Sprintf(", kube-apiserver %s", cfg.K8sAPIServerConfig().Image())
		}

		return fmt.Sprintf("%s config valid for Talos %s (%s)", shape, talosversion.Tag, images), nil
	}
}

// patchAndApply patches the node's config and applies it the 1.14 way: mode NO_REBOOT (REBOOT, the proto
// default, is refused outside maintenance mode).
func patchAndApply(ctx context.Context, c *client.Client, cfg config.Provider, patch []byte) (*machineapi.ApplyConfigurationResponse, error) {
	p, err := stdpatches.PreparePatch(patch, nil)
	if err != nil {
		return nil, err
	}

	out, err := configpatcher.Apply(configpatcher.WithConfig(cfg), []configpatcher.Patch{p})
	if err != nil {
		return nil, err
	}

	data, err := out.Bytes()
	if err != nil {
		return nil, err
	}

	return c.ApplyConfiguration(ctx, &machineapi.ApplyConfigurationRequest{
		Data: data,
		Mode: machineapi.ApplyConfigurationRequest_NO_REBOOT,
	})
}

// bumpPatch returns the image with its tag's patch version raised by one.
func bumpPatch(image string) (string, error) {
	idx := strings.LastIndex(image, ":v")
	if idx < 0 {
		return "", fmt.Errorf("image %q has no version tag", image)
	}

	v, err := semver.Parse(image[idx+2:])
	if err != nil {
		return "", err
	}

	v.Patch++

	return fmt.Sprintf("%s:v%s", image[:idx], v), nil
}

// checkApplyAPIServerImage is one step of `talosctl upgrade-k8s` 1.14 (pkg/cluster/kubernetes): the shape of
// the patch is guessed from the node's config (GuessVersionContractKubeAPIServer), so a config with the
// KubeAPIServerConfig document gets a partial document of that kind, applied with NO_REBOOT.
func checkApplyAPIServerImage(ctx context.Context, c *client.Client) (string, error) {
	cfg, err := machineConfig(ctx, c)
	if err != nil {
		return "", err
	}

	if !cfg.Has(k8s.KubeAPIServerConfig) {
		return "", errors.New("the config has no KubeAPIServerConfig document")
	}

	want, err := bumpPatch(cfg.K8sAPIServerConfig().Image())
	if err != nil {
		return "", err
	}

	resp, err := patchAndApply(ctx, c, cfg, must(stdpatches.WithKubeAPIServerImage(stdpatches.GuessVersionContractKubeAPIServer(cfg), want)))
	if err != nil {
		return "", fmt.Errorf("ApplyConfiguration: %w", err)
	}

	reply, err := single(resp.GetMessages())
	if err != nil {
		return "", err
	}

	if reply.GetMode() != machineapi.ApplyConfigurationRequest_NO_REBOOT {
		return "", fmt.Errorf("applied in mode %s, want NO_REBOOT", reply.GetMode())
	}

	after, err := machineConfig(ctx, c)
	if err != nil {
		return "", err
	}

	if got := after.K8sAPIServerConfig().Image(); got != want || after.RawV1Alpha1().ClusterConfig.APIServerConfig != nil { //nolint:staticcheck
		return "", fmt.Errorf("after the apply: image %q (want %q), .cluster.apiServer set=%v", got, want,
			after.RawV1Alpha1().ClusterConfig.APIServerConfig != nil) //nolint:staticcheck
	}

	if err = validate(after); err != nil {
		return "", fmt.Errorf("the applied config does not validate: %w", err)
	}

	return fmt.Sprintf("%s, %q", want, reply.GetModeDetails()), nil
}

// checkApplyConflictRefused is the version-mixing hazard: a tool that always writes the v1alpha1 field (the
// 1.13 contract) adds .cluster.apiServer next to KubeAPIServerConfig, which the node must refuse whole.
func checkApplyConflictRefused(ctx context.Context, c *client.Client) (string, error) {
	cfg, err := machineConfig(ctx, c)
	if err != nil {
		return "", err
	}

	image := cfg.K8sAPIServerConfig().Image()

	_, refusal := patchAndApply(ctx, c, cfg, must(stdpatches.WithKubeAPIServerImage(config.TalosVersion1_13, image)))

	const want = "kube-apiserver config is already set in v1alpha1 config (.cluster.apiServer)"

	switch {
	case refusal == nil:
		return "", errors.New("a config with both KubeAPIServerConfig and .cluster.apiServer was accepted")
	case status.Code(refusal) != codes.InvalidArgument || !strings.Contains(refusal.Error(), want):
		return "", fmt.Errorf("want InvalidArgument with %q, got: %w", want, refusal)
	}

	after, err := machineConfig(ctx, c)
	if err != nil {
		return "", err
	}

	if after.RawV1Alpha1().ClusterConfig.APIServerConfig != nil { //nolint:staticcheck
		return "", errors.New("the refused config was stored")
	}

	return fmt.Sprintf("refused (%s): %s", status.Code(refusal), strings.Join(strings.Fields(status.Convert(refusal).Message()), " ")), nil
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}

	return b
}

// pull is `ImageService.Pull` into the system containerd (what talosctl 1.14 upgrade does before the
// LifecycleService call); it returns the pulled name.
func pull(ctx context.Context, c *client.Client, ref string) (string, error) {
	stream, err := c.ImageClient.Pull(ctx, &machineapi.ImageServicePullRequest{ImageRef: ref})
	if err != nil {
		return "", err
	}

	name := ""

	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return name, nil
		}

		if err != nil {
			return "", err
		}

		if n := msg.GetName(); n != "" {
			name = n
		}
	}
}

// checkPullGenericInstaller: from 1.14 on the generic installer (gendata registry/username + "/installer")
// is not published, so a pull of this release's tag is NotFound, in one attempt.
func checkPullGenericInstaller(ctx context.Context, c *client.Client) (string, error) {
	ref := fmt.Sprintf("%s/%s/installer:%s", gendata.ImagesRegistry, gendata.ImagesUsername, talosversion.Tag)

	_, err := pull(ctx, c, ref)
	if status.Code(err) != codes.NotFound {
		return "", fmt.Errorf("pull %s: want NotFound, got %v", ref, err)
	}

	return fmt.Sprintf("%s: %s", ref, status.Convert(err).Message()), nil
}

// emptySchematic is the Image Factory's schematic with no customization (talos pkg/images
// DefaultInstallerImageSchematic; talosctl ImageFactoryEmptySchematicID).
const emptySchematic = "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba"

// checkPullFactoryInstaller pulls what Omni builds for the node: the factory installer for the node's
// platform and schematic (the empty one without a schematic), at this release's tag.
func checkPullFactoryInstaller(ctx context.Context, c *client.Client) (string, error) {
	md, err := safe.StateGetByID[*runtime.PlatformMetadata](ctx, c.COSI, runtime.PlatformMetadataID)
	if err != nil {
		return "", fmt.Errorf("PlatformMetadata: %w", err)
	}

	schematic := emptySchematic

	if s, err := safe.StateGetByID[*runtime.ImageFactorySchematic](ctx, c.COSI, runtime.ImageFactorySchematicID); err == nil {
		schematic = s.TypedSpec().SchematicID
	}

	ref := fmt.Sprintf("%s/%s-installer/%s:%s", gendata.ImageFactory, strings.ToLower(md.TypedSpec().Platform), schematic,
		talosversion.Tag)

	name, err := pull(ctx, c, ref)
	if err != nil {
		return "", fmt.Errorf("pull %s: %w", ref, err)
	}

	if name == "" {
		return "", fmt.Errorf("pull %s: no name in the reply", ref)
	}

	return fmt.Sprintf("%s -> %s", ref, name), nil
}
