// Renders an Ollama TEMPLATE the way Ollama's server does (template/template.go, Template.Execute on the
// .Messages path): Go's text/template with Option("missingkey=zero") and Ollama's template functions, the
// messages collated as Ollama's collate() does (system messages gathered into .System; consecutive messages of one
// role other than tool joined by a blank line), and the fields Ollama gives a template: .System, .Messages (Role,
// Content, ToolCalls with .ID and .Function.Name/.Arguments, ToolName, ToolCallID), .Tools, .Response.
// Tool schemas, arguments and tools print as compact JSON (their String methods), as in Ollama.
//
// Written for rocktune's tests (no Ollama code): go run ollama_render.go < {"template", "messages", "tools"}
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
)

type args map[string]any

func (a args) String() string {
	if a == nil {
		return "{}"
	}
	b, _ := json.Marshal(map[string]any(a))
	return string(b)
}

type callFunction struct {
	Index     int
	Name      string
	Arguments args
}

type toolCall struct {
	ID       string
	Function callFunction
}

type message struct {
	Role       string
	Content    string
	Thinking   string
	ToolCalls  []toolCall
	ToolName   string
	ToolCallID string
}

type tool map[string]any

func (t tool) String() string {
	b, _ := json.Marshal(map[string]any(t))
	return string(b)
}

type tools []tool

func (t tools) String() string {
	b, _ := json.Marshal(t)
	return string(b)
}

type input struct {
	Template string `json:"template"`
	Messages []struct {
		Role       string `json:"role"`
		Content    string `json:"content"`
		ToolCallID string `json:"tool_call_id"`
		Name       string `json:"name"`
		ToolCalls  []struct {
			ID       string `json:"id"`
			Function struct {
				Name      string         `json:"name"`
				Arguments map[string]any `json:"arguments"`
			} `json:"function"`
		} `json:"tool_calls"`
	} `json:"messages"`
	Tools []map[string]any `json:"tools"`
}

var funcs = template.FuncMap{
	"json": func(v any) string {
		b, _ := json.Marshal(v)
		return string(b)
	},
}

func main() {
	var in input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var system []string
	var msgs []*message
	for _, m := range in.Messages {
		if m.Role == "system" {
			system = append(system, m.Content)
		}
		if n := len(msgs); n > 0 && msgs[n-1].Role == m.Role && m.Role != "tool" {
			msgs[n-1].Content += "\n\n" + m.Content
			continue
		}
		msg := &message{Role: m.Role, Content: m.Content, ToolName: m.Name, ToolCallID: m.ToolCallID}
		for i, c := range m.ToolCalls {
			msg.ToolCalls = append(msg.ToolCalls, toolCall{ID: c.ID, Function: callFunction{Index: i, Name: c.Function.Name, Arguments: c.Function.Arguments}})
		}
		msgs = append(msgs, msg)
	}
	var ts tools
	for _, t := range in.Tools {
		ts = append(ts, tool(t))
	}
	tmpl, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(in.Template)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
	err = tmpl.Execute(os.Stdout, map[string]any{"System": strings.Join(system, "\n\n"), "Messages": msgs,
		"Tools": ts, "Response": "", "Think": false})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(4)
	}
}
